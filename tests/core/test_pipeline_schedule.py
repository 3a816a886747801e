"""1F1B in a real 4-stage gloo world: the activation bound, and the schedules' building blocks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_world

from megatron_lite.core import parallel_state as ps
from megatron_lite.core.datasets.gpt_dataset import MockGPTDataset
from megatron_lite.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.core.pipeline_parallel import get_forward_backward_func
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.data.samplers import build_pretraining_data_loader
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.forward_step_func_types import prepare_forward_step_func
from megatron_lite.training.gpt_step import forward_step
from megatron_lite.training.memory.saved_tensors import ActivationMemoryTracker
from megatron_lite.training.state import GlobalState

SEQ, MBS = 32, 2


def _peak_activation_bytes(rank, world, microbatches_list):
    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    cfg = GPTModelProvider(
        num_layers=world * 2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=256,
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        pipeline_model_parallel_size=world,
    )
    module = cfg.provide()  # first / last stage from parallel_state's pipeline group
    model = DistributedDataParallel(cfg, module, dp_group=pgc.dp)
    cfg.finalize_model_grads_func = finalize_model_grads
    schedule = get_forward_backward_func()
    step = prepare_forward_step_func(forward_step, GlobalState(ConfigContainer()))
    peaks = []
    for num_microbatches in microbatches_list:
        tracker = ActivationMemoryTracker()
        tracker.exclude_parameters(module.parameters())
        data = MockGPTDataset(vocab_size=256, sequence_length=SEQ, seed=3, num_samples=1000)
        it = iter(build_pretraining_data_loader(data, 0, MBS, 0, 1))
        model.zero_grad_buffer()
        with tracker.track():
            losses = schedule(
                forward_step_func=step,
                data_iterator=it,
                model=[model],
                num_microbatches=num_microbatches,
                seq_length=SEQ,
                micro_batch_size=MBS,
            )
        assert tracker.current_bytes == 0, "all saved activations are released after the step"
        assert len(losses) == (num_microbatches if ps.is_pipeline_last_stage() else 0)
        peaks.append(tracker.peak_bytes)
    ps.destroy_model_parallel()
    return peaks


@pytest.mark.world
def test_stage_i_holds_at_most_pp_minus_i_microbatches():
    pp = 4
    results = run_world(_peak_activation_bytes, pp, [1, 8])
    for stage, (one, eight) in enumerate(results):
        assert one > 0
        in_flight = eight / one
        assert in_flight <= (pp - stage) + 1e-6, (stage, in_flight)
        assert in_flight >= (pp - stage) - 1e-6, (stage, in_flight)  # 1F1B fills exactly pp - i
    # The first stage is where the pipeline's activation peak lives.
    assert results[0][1] == max(r[1] for r in results)


def _p2p_roundtrip(rank, world):
    from megatron_lite.core.pipeline_parallel.p2p_communication import P2PCommunicator

    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    cfg = GPTModelProvider(num_layers=world, hidden_size=8, num_attention_heads=2)
    p2p = P2PCommunicator(ps.get_pipeline_model_parallel_group(), cfg)
    shape = (3, 2, 8)
    received = p2p.recv_forward(shape)
    value = torch.zeros(shape) if received is None else received.detach()
    p2p.send_forward(value + rank + 1)  # stage i sends 1 + 2 + ... + (i + 1)
    grad = p2p.recv_backward(shape)
    p2p.send_backward(torch.full(shape, float(rank)) if grad is None else grad.detach() * 2)
    out = (None if received is None else received.mean().item(), None if grad is None else grad.mean().item())
    p2p.wait_for_sends()  # gloo sends complete lazily: the last one must land before the group goes
    ps.destroy_model_parallel()
    return out


@pytest.mark.world
def test_named_p2p_calls_are_noops_at_the_ends():
    results = run_world(_p2p_roundtrip, 3)
    assert results[0] == (None, 4.0)  # first stage receives nothing forward; grad 2 * 2 from stage 1
    assert results[1] == (1.0, 2.0)
    assert results[2] == (3.0, None)  # last stage receives 1 + 2, and no gradient


def test_lr_schedule_matches_megatron_semantics():
    from megatron_lite.core.optimizer import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=10,
        lr_decay_steps=110,
        lr_decay_style="linear",
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=100,
        wd_incr_style="linear",
    )
    assert opt.param_groups[0]["lr"] == 0.0
    sched.step(5)
    assert opt.param_groups[0]["lr"] == 0.5
    assert abs(opt.param_groups[0]["weight_decay"] - 0.005) < 1e-12  # 5 of 100 steps up to 0.1
    sched.step(55)  # halfway through decay
    assert abs(opt.param_groups[0]["lr"] - 0.55) < 1e-12
    sched.step(100)
    assert opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[0]["weight_decay"] == 0.1  # past wd_incr_steps: end_wd
    # Resuming under another schedule is refused in Megatron's words unless one side is chosen.
    saved = sched.state_dict()
    assert "2.0 for learning rate do not match" in sched.checkpoint_mismatch({**saved, "max_lr": 2.0})
    sched.override_opt_param_scheduler = True
    sched.load_state_dict({**saved, "max_lr": 2.0})
    assert sched.max_lr == 1.0 and sched.num_steps == saved["num_steps"]
    cosine = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=100,
    )
    cosine.step(50)
    assert abs(opt.param_groups[0]["lr"] - 0.5) < 1e-12


def _bf16_optimizer(rank, world):
    from megatron_lite.core.optimizer import MegatronOptimizer, OptimizerConfig

    ps.initialize_model_parallel()
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    cfg = GPTModelProvider(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=128, bf16=True)
    model = DistributedDataParallel(cfg, cfg.provide(pre_process=True, post_process=True), dp_group=pgc.dp)
    opt = MegatronOptimizer(OptimizerConfig(bf16=True, lr=1e-2), [model], model_parallel_group=pgc.mp)
    tokens = torch.randint(0, 128, (2, 16))
    loss = model(tokens, torch.arange(16).expand(2, 16), labels=tokens).float().mean()
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    ok, norm, _ = opt.step()
    state_dtypes = {t.dtype for s in opt.optimizer.state.values() for t in s.values() if t.dim() > 0}
    changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    ps.destroy_model_parallel()
    return (
        ok,
        norm > 0,
        {p.dtype for p in model.parameters()},
        {u.main.dtype for u in opt.units},
        state_dtypes,
        changed,
    )


@pytest.mark.world
def test_bf16_keeps_fp32_master_weights_and_state():
    ok, has_norm, param_dtypes, master_dtypes, state_dtypes, changed = run_world(_bf16_optimizer, 1)[0]
    assert ok and has_norm and changed
    assert param_dtypes == {torch.bfloat16}
    assert master_dtypes == {torch.float32} and state_dtypes == {torch.float32}


def _dp_grads_equal(rank, world):
    ps.initialize_model_parallel()
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    cfg = GPTModelProvider(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=128)
    model = DistributedDataParallel(cfg, cfg.provide(pre_process=True, post_process=True), dp_group=pgc.dp)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(tokens, torch.arange(16).expand(2, 16), labels=tokens).mean().backward()
    local = torch.cat([p.main_grad.flatten() for p in model.parameters()]).clone()
    model.finish_grad_sync()
    synced = torch.cat([p.main_grad.flatten() for p in model.parameters()])
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    ps.destroy_model_parallel()
    return torch.allclose(synced, torch.stack(everyone).mean(0), atol=1e-7), not torch.equal(local, synced)


@pytest.mark.world
def test_data_parallel_averages_gradients_once():
    assert run_world(_dp_grads_equal, 2) == [(True, True), (True, True)]


def _nan_handling(rank, world):
    import contextlib
    import io
    import math

    from megatron_lite.core.optimizer import MegatronOptimizer, OptimizerConfig, OptimizerParamScheduler
    from megatron_lite.training.config import ConfigContainer
    from megatron_lite.training.state import GlobalState
    from megatron_lite.training.training import training_log

    ps.initialize_model_parallel()
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    cfg = GPTModelProvider(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=128)
    model = DistributedDataParallel(cfg, cfg.provide(pre_process=True, post_process=True), dp_group=pgc.dp)
    opt = MegatronOptimizer(OptimizerConfig(lr=1e-2), [model], model_parallel_group=pgc.mp)
    OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=10,
        lr_decay_style="constant",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=10,
    )
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.main_grad.fill_(float("nan"))
    ok, grad_norm, _ = opt.step()
    unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))

    config = ConfigContainer()
    config.set_data_parallel_size()  # as validate does; training_log reports the batch size
    state = GlobalState(config)
    state.cfg.logger.log_interval = 2
    state.timers("interval-time", log_level=0).start()
    from megatron_lite.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator

    reconfigure_num_microbatches_calculator(0, None, 16, 2, 1)  # training_log reports the batch size
    totals: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for step, (loss, skipped) in enumerate([(float("nan"), 1), (2.0, 0)], start=1):
            state.train_state.step = step
            training_log(
                {"lm loss": torch.tensor(loss)},
                totals,
                1e-2,
                None,  # decoupled learning rate
                1.0,
                False,
                skipped,
                grad_norm,
                None,
                None,
                state.cfg,
                state,
                [],  # history_wct
                [model],
                pg_collection=pgc,
            )
    lines = out.getvalue().splitlines()
    ps.destroy_model_parallel()
    return ok, math.isnan(grad_norm), unchanged, lines


@pytest.mark.world
def test_nan_gradients_skip_the_update_and_are_counted():
    ok, norm_is_nan, unchanged, lines = run_world(_nan_handling, 1)[0]
    assert not ok and norm_is_nan and unchanged
    assert len(lines) == 1
    line = lines[0]
    assert "number of skipped iterations:   1" in line and "number of nan iterations:   1" in line
    assert "lm loss: 2.000000E+00" in line  # the skipped iteration's NaN is not averaged in


def _rng_streams(rank, world):
    from megatron_lite.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234, tp_rank=rank)
    with get_cuda_rng_tracker().fork():
        tp_stream = torch.rand(4)
    default_stream = torch.rand(4)
    torch.manual_seed(1234)
    untouched = torch.rand(4)
    # Lists, not tensors: a tensor's shared memory must outlive the worker process to be read back.
    return tp_stream.tolist(), default_stream.tolist(), untouched.tolist()


@pytest.mark.world
def test_dropout_streams_differ_per_tp_rank_and_leave_the_default_stream_alone():
    (tp0, default0, plain0), (tp1, default1, plain1) = run_world(_rng_streams, 2)
    assert tp0 != tp1  # attention dropout: different heads, different masks
    assert default0 == default1  # hidden dropout: the same mask on every TP rank
    assert default0 == plain0  # forking did not advance the default stream
