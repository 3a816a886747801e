"""Resuming runs across Megatron-LM and megatron_lite, in both directions, checked with megatron-core's
own code: a Megatron-LM ``torch_dist`` run (megatron-core's FP32Optimizer state after an Adam step)
resumes in megatron_lite with its moments, step, schedule and data position; a megatron_lite one holds
each key Megatron-LM's ``load_checkpoint`` reads, meaning what it means there."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from dist_helpers import run_pretrain, run_world
from mcore_helpers import assert_same, mcore_save_on_cpu, poison, tensors
from megatron_lm_helpers import (
    LLAMA_FLAGS,
    TRAIN,
    fp32_optimizer,
    mcore_llama,
    megatron_lm_args,
    megatron_lm_schedule,
    our_resume,
    te_state_dict,
    track_latest,
)

pytestmark = pytest.mark.world  # every test here starts processes


def _megatron_lm_run_state(rank, world, root, fmt):
    """A Megatron-LM checkpoint (``fmt``) of a run at iteration 7 (tp 2, fp32, torch's Adam after one
    step in megatron-core's own param groups, its FP32Optimizer's state), then megatron_lite's setup
    resuming it in the same world: what each side holds, by parameter name."""
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    llama = mcore_llama()
    config = OptimizerConfig(lr=3e-4, min_lr=3e-5, weight_decay=0.1)
    adam = torch.optim.Adam(_get_param_groups([llama], config, None), lr=3e-4, weight_decay=0.1)
    for n, p in llama.named_parameters():  # a replicated parameter's gradient is the same on every rank
        split = getattr(p, "tensor_model_parallel", False)
        gen = torch.Generator().manual_seed(zlib.crc32(n.encode()) + (1000 * rank if split else 0))
        p.grad = torch.randn(p.shape, generator=gen)
    adam.step()
    optimizer = fp32_optimizer(adam)  # Megatron-LM's FP32Optimizer
    model_sd = llama.sharded_state_dict()
    state = {"args": megatron_lm_args(tensor_model_parallel_size=2, lr=3e-4, min_lr=3e-5, weight_decay=0.1)}
    state |= {"checkpoint_version": 3.0, "iteration": 7, "num_floating_point_operations_so_far": 1.0e9}
    schedule = megatron_lm_schedule() | {
        "num_steps": 112,
        "start_wd": 0.1,
        "end_wd": 0.1,
        "wd_incr_steps": 800,
    }
    state |= {"opt_param_scheduler": schedule | {"wd_incr_style": "constant", "min_lr": 3e-5}}
    if fmt == "torch_dist":
        state |= {"optimizer": optimizer.sharded_state_dict(model_sd), "model": model_sd}
        os.makedirs(os.path.join(root, "iter_0000007"), exist_ok=True)
        with mcore_save_on_cpu():
            mcore_dist_checkpointing.save(state, os.path.join(root, "iter_0000007"))
    else:  # its torch format: torch's own state dict, parameters numbered in megatron-core's groups
        state |= {"optimizer": optimizer.state_dict(), "model": te_state_dict(llama)}
        shard = os.path.join(root, "iter_0000007", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
        os.makedirs(os.path.dirname(shard), exist_ok=True)
        torch.save(state, shard)
    track_latest(root, 7)
    names = {id(p): n for n, p in llama.named_parameters()}
    theirs = {names[id(p)]: (s["exp_avg"], s["exp_avg_sq"], float(s["step"])) for p, s in adam.state.items()}
    sched = OptimizerParamScheduler(adam, 0.0, 3e-4, 3e-5, 16, 800, "cosine", 0.1, 0.1, 800, "constant")
    sched.num_steps = 112
    their_lr = sched.get_lr(adam.param_groups[0])

    from megatron.core import parallel_state as mps

    from megatron_lite.core import parallel_state

    mps.destroy_model_parallel()
    argv = [
        *TRAIN,
        "--load",
        root,
        "--tensor-model-parallel-size",
        "2",
        "--use-checkpoint-opt-param-scheduler",
    ]
    s, ours = our_resume(argv)
    opt = s.optimizer
    ts = s.state.train_state
    result = dict(
        theirs=theirs, ours=ours, their_lr=their_lr, our_lr=opt.optimizer.param_groups[0]["lr"],
        train_state=(ts.step, ts.consumed_train_samples), num_steps=s.scheduler.num_steps,
    )  # fmt: skip
    parallel_state.destroy_model_parallel()
    return result


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_megatron_lm_run_resumes_with_its_optimizer_state_schedule_and_position(tmp_path, fmt):
    for rank, r in enumerate(run_world(_megatron_lm_run_state, 2, str(tmp_path / "run"), fmt)):
        assert r["ours"].keys() == r["theirs"].keys(), sorted(r["ours"].keys() ^ r["theirs"].keys())
        for name, (exp_avg, exp_avg_sq, step) in r["theirs"].items():
            ours = r["ours"][name]
            assert torch.equal(ours[0], exp_avg) and torch.equal(ours[1], exp_avg_sq), (rank, name)
            assert ours[2] == step == 1.0
        assert r["train_state"] == (7, 112) and r["num_steps"] == 112
        assert r["our_lr"] == pytest.approx(r["their_lr"], rel=1e-12)


def _megatron_core_load(root: str, iteration: int):
    """What Megatron-LM's load_checkpoint does with our torch_dist checkpoint, with megatron-core's own
    code: its request (the model and FP32Optimizer's sharded state; no RNG, as our args say), the
    model's and the optimizer's load. Returns (model, FP32Optimizer, torch's Adam, what was loaded)."""
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    llama = mcore_llama()
    poison(llama)
    groups = _get_param_groups([llama], OptimizerConfig(lr=1e-3, weight_decay=0.01), None)  # megatron-core's
    adam = torch.optim.Adam(groups, lr=1e-3, weight_decay=0.01)
    optimizer = fp32_optimizer(adam)
    model_sd = llama.sharded_state_dict()
    request = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}
    # Megatron-LM's --dist-ckpt-strictness log_all: its layers' _extra_state objects (Transformer Engine's
    # FP8 metadata; None here), which ours do not have, are dropped from the request with a log line.
    directory = os.path.join(root, f"iter_{iteration:07d}")
    loaded = mcore_dist_checkpointing.load(request, directory, strict=StrictHandling.LOG_ALL)
    llama.load_state_dict(loaded["model"], strict=False)
    optimizer.load_state_dict(loaded["optimizer"])  # FP32Optimizer's: common_step, its param-group matching
    return llama, optimizer, adam, loaded


def _megatron_core_resumes_ours(rank, world, root):
    """Each step of Megatron-LM's load of our checkpoint (``_megatron_core_load``), what it saw, beside
    our own load of the same checkpoint."""
    from megatron.core import parallel_state as mps
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    llama, optimizer, adam, loaded = _megatron_core_load(root, 3)
    args = loaded["args"]
    seen = {
        k: getattr(args, k)
        for k in ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding")
    }
    seen |= {
        k: getattr(args, k)
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size")
    }
    seen |= {
        k: getattr(args, k) for k in ("no_save_optim", "no_save_rng", "consumed_train_samples", "swiglu")
    }
    seen |= {k: loaded[k] for k in ("checkpoint_version", "iteration")}
    scheduler = OptimizerParamScheduler(adam, 0.0, 1.0, 0.0, 1, 2, "linear", 0.0, 0.0, 1, "constant")
    scheduler.use_checkpoint_opt_param_scheduler = True
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    seen["num_steps"], seen["lr"] = scheduler.num_steps, scheduler.get_lr(adam.param_groups[0])
    names = {id(p): n for n, p in llama.named_parameters()}
    theirs = {names[id(p)]: (s["exp_avg"], s["exp_avg_sq"], float(s["step"])) for p, s in adam.state.items()}
    their_weights = tensors(llama)
    mps.destroy_model_parallel()

    from megatron_lite.core import parallel_state

    argv = [
        *LLAMA_FLAGS,
        *TRAIN[:-3],
        "--load",
        root,
        "--train-iters",
        "4",
        "--use-checkpoint-opt-param-scheduler",
    ]
    s, ours = our_resume(argv)
    our_weights = {k.removeprefix("module."): v for k, v in s.model[0].state_dict().items()}
    our_lr = s.optimizer.optimizer.param_groups[0]["lr"]
    parallel_state.destroy_model_parallel()
    return seen, theirs, ours, their_weights, our_weights, our_lr


def test_megatron_lm_resumes_our_torch_dist_checkpoint(tmp_path):
    """Back out: each key Megatron-LM's load_checkpoint reads is there and means what it does there."""
    run = [*LLAMA_FLAGS, *TRAIN[:-3], "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-4"]
    run += ["--save", "ours", "--ckpt-format", "torch_dist", "--save-interval", "3", "--nproc-per-node", "2"]
    result = run_pretrain(run, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for seen, theirs, ours, their_weights, our_weights, our_lr in run_world(
        _megatron_core_resumes_ours, 2, str(tmp_path / "ours")
    ):
        assert seen == {
            "num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "add_position_embedding": False,
            "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "world_size": 2,
            "no_save_optim": False, "no_save_rng": True, "consumed_train_samples": 6, "swiglu": True,
            "checkpoint_version": 3.0, "iteration": 3, "num_steps": 6, "lr": pytest.approx(our_lr, rel=1e-12),
        }  # fmt: skip
        assert theirs.keys() == ours.keys()
        for name, (exp_avg, exp_avg_sq, step) in ours.items():
            assert torch.equal(theirs[name][0], exp_avg) and torch.equal(theirs[name][1], exp_avg_sq), name
            assert theirs[name][2] == step == 3.0, name
        assert_same(their_weights, {k: v for k, v in our_weights.items() if k in their_weights})


def _megatron_core_saves_what_it_loaded(rank, world, ours: str, theirs: str) -> None:
    """Megatron-LM's round trip on our checkpoint: its load (``_megatron_core_load``), then its
    torch_dist save of that state as its ``generate_state_dict`` lays it out."""
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing

    llama, optimizer, _, loaded = _megatron_core_load(ours, 2)
    state = {k: loaded[k] for k in ("args", "checkpoint_version", "iteration", "opt_param_scheduler")}
    state["num_floating_point_operations_so_far"] = loaded["num_floating_point_operations_so_far"]
    model_sd = llama.sharded_state_dict()
    state |= {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
    os.makedirs(os.path.join(theirs, "iter_0000002"), exist_ok=True)
    with mcore_save_on_cpu():
        mcore_dist_checkpointing.save(state, os.path.join(theirs, "iter_0000002"))
    track_latest(theirs, 2)


def test_a_run_through_megatron_lm_and_back_continues_with_the_losses_of_an_unbroken_one(tmp_path):
    """Ours for 2 iterations, through megatron-core's load and Megatron-LM-shaped save, resumed by ours
    for 2 more: the losses of iterations 3 and 4 are an unbroken 4-iteration run's."""
    from dist_helpers import parse_losses

    run = [*LLAMA_FLAGS, *TRAIN[:-3], "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-iters", "4"]
    run += ["--nproc-per-node", "2", "--log-interval", "1"]  # the schedule of 4 iterations in every run
    run[run.index("--global-batch-size") + 1] = "4"
    unbroken = run_pretrain([*run, "--train-iters", "4"], tmp_path)
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    first = run_pretrain(
        [*run, "--train-iters", "2", "--save", "ours", "--ckpt-format", "torch_dist"], tmp_path
    )
    assert first.returncode == 0, first.stderr[-3000:]
    run_world(_megatron_core_saves_what_it_loaded, 2, str(tmp_path / "ours"), str(tmp_path / "theirs"))
    # The weight-decay schedule counts --train-iters (constant here): the checkpoint's is taken.
    resume = ["--train-iters", "4", "--load", "theirs", "--use-checkpoint-opt-param-scheduler"]
    resumed = run_pretrain([*run, *resume], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "random generator states are Megatron-LM's" in resumed.stdout
    expected, got = parse_losses(unbroken.stdout), parse_losses(resumed.stdout)
    assert sorted(got) == [3, 4]
    for iteration in (3, 4):
        assert got[iteration] == expected[iteration]  # as printed (6 digits)
