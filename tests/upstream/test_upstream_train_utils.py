"""Upstream's train_utils surface (Megatron-Bridge training/utils/train_utils.py): training_log's
console line, memory flag and MoE calls, the reports, norms and forward-step injection. What reaches
each dashboard is read back from real sinks in tests/training/test_metrics.py."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from dist_helpers import run_world

from megatron_lite.core import num_microbatches_calculator as nmc
from megatron_lite.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron_lite.core.transformer.moe.moe_utils import track_moe_metrics
from megatron_lite.training.utils import train_utils
from megatron_lite.training.utils.train_utils import (
    MEMORY_KEYS,
    calc_params_l2_norm,
    maybe_inject_state,
    needs_global_state_injection,
    param_is_not_shared,
    prepare_forward_step_func,
    report_l2_norm_grad,
    report_memory,
    report_runtime,
    report_throughput,
    training_log,
)

TU = "megatron_lite.training.utils.train_utils"

# The dashboard contract: upstream's tag names, spelling included.
UPSTREAM_TAGS = [
    "mem-allocated-gigabytes",
    "mem-active-gigabytes",
    "mem-inactive-gigabytes",
    "mem-reserved-gigabytes",
    "mem-max-allocated-gigabytes",
    "mem-max-active-gigabytes",
    "mem-max-inactive-gigabytes",
    "mem-max-reserved-gigabytes",
    "mem-alloc-retires",
    "mem-allocated-count",
]


def test_memory_keys_are_upstreams_in_order():
    assert list(MEMORY_KEYS) == [
        "allocated_bytes.all.current",
        "active_bytes.all.current",
        "inactive_split_bytes.all.current",
        "reserved_bytes.all.current",
        "allocated_bytes.all.peak",
        "active_bytes.all.peak",
        "inactive_split_bytes.all.peak",
        "reserved_bytes.all.peak",
        "num_alloc_retries",
        "allocation.all.current",
    ]
    assert [n.replace("bytes", "gigabytes") for n in MEMORY_KEYS.values()] == UPSTREAM_TAGS


def test_cuda_report_has_upstream_names_then_our_extras(mocker):
    from megatron_lite.training.memory.saved_tensors import ACTIVATION_MEMORY

    mocker.patch.object(ACTIVATION_MEMORY, "tracking", True)  # as after a tracked (reported) step
    mocker.patch.object(ACTIVATION_MEMORY, "tracked_once", True)
    mocker.patch("torch.cuda.is_available", return_value=True)
    mocker.patch("torch.cuda.is_initialized", return_value=True)
    stats = {k: 1_234_567_890 for k in MEMORY_KEYS} | {"num_alloc_retries": 3, "num_ooms": 2}
    stats["allocation.all.current"] = 41
    mocker.patch("torch.cuda.memory_stats", return_value=stats)
    report = report_memory(None)
    assert list(report)[:10] == UPSTREAM_TAGS
    assert list(report)[10:] == [
        "mem-ooms",
        "mem-fragmentation",
        "mem-alloc-retries-delta",
        "mem-activation-gigabytes",
        "mem-max-activation-gigabytes",
    ]
    assert report["mem-max-reserved-gigabytes"] == 1.2346  # 5 significant digits
    assert report["mem-alloc-retires"] == 3 and report["mem-allocated-count"] == 41
    assert report_memory({}) == report  # empty means the default, as upstream


def _config(**logger):
    config = mock.MagicMock()
    lg = config.logger
    lg.log_interval, lg.tensorboard_log_interval, lg.timing_log_level = 5, 1, 0
    lg.memory_keys = None
    for flag in (
        "log_timers_to_tensorboard",
        "log_memory_to_tensorboard",
        "log_throughput",
        "log_throughput_to_tensorboard",
        "log_runtime_to_tensorboard",
        "log_l2_norm_grad_to_tensorboard",
        "log_loss_scale_to_tensorboard",
        "log_world_size_to_tensorboard",
    ):
        setattr(lg, flag, False)
    for key, value in logger.items():
        setattr(lg, key, value)
    config.train.micro_batch_size, config.train.train_iters = 2, 100
    config.data_parallel_size = 2
    config.optimizer.decoupled_lr = None
    config.model = SimpleNamespace(num_layers=2)  # no attention shapes: no FLOPs line
    return config


def _state(step, *, loggers=True):
    state = mock.MagicMock()
    state.train_state = SimpleNamespace(
        step=step,
        consumed_train_samples=step * 16,
        skipped_train_samples=0,
        floating_point_operations_so_far=0,
    )
    state.timers.return_value.elapsed.return_value = 2.0
    state.energy_monitor = None
    if not loggers:
        state.tensorboard_logger = state.wandb_logger = state.mlflow_logger = state.comet_logger = None
    return state


@pytest.fixture
def patched(mocker):
    mocker.patch(f"{TU}.get_num_microbatches", return_value=4)
    mocker.patch(f"{TU}.reduce_max_stat_across_model_parallel_group", side_effect=lambda v, mp_group: v)
    mocker.patch(f"{TU}.get_world_size_safe", return_value=8)
    return SimpleNamespace(
        print_last=mocker.patch(f"{TU}.print_rank_last"),
        reduce=mocker.patch(
            f"{TU}.reduce_max_memory_across_pp_group", side_effect=lambda r, g: {**r, "x": 9}
        ),
        report=mocker.patch(f"{TU}.report_memory", return_value={"mem-max-allocated-gigabytes": 1.5}),
    )


def _log(state, config, loss=2.0, skipped=0, totals=None, **kw):
    return training_log(
        {"lm loss": torch.tensor(loss)},
        {} if totals is None else totals,
        1e-3,
        None,
        1.0,
        kw.pop("report_memory_flag", False),
        skipped,
        kw.pop("grad_norm", None),
        None,
        None,
        config,
        state,
        [],
        [],
        pg_collection=SimpleNamespace(mp="mp", pp="pp", dp="dp"),
        **kw,
    )


def test_memory_is_reduced_on_a_rank_without_loggers(patched):
    config = _config(log_memory_to_tensorboard=True)
    _log(_state(3, loggers=False), config)
    patched.reduce.assert_called_once_with({"mem-max-allocated-gigabytes": 1.5}, "pp")


@pytest.mark.parametrize("loggers", [True, False], ids=["writer-rank", "other-rank"])
def test_one_timer_gather_per_dashboard_step_and_the_same_collectives_on_every_rank(patched, loggers):
    """The timers are gathered once for every sink (upstream: once per sink), on a rank with loggers
    and one without alike; so are the other reductions."""
    config = _config(log_timers_to_tensorboard=True, log_memory_to_tensorboard=True, timing_log_level=1)
    for step in (1, 2):
        state = _state(step, loggers=loggers)
        _log(state, config)
        assert state.timers.write.call_count == 1  # one gather, through upstream's Timers.write
        assert state.timers.write.call_args.kwargs == {"normalizer": 1, "reset": True}
    assert patched.reduce.call_count == 2  # the memory MAX, every step, every rank


def test_a_memory_report_from_the_loop_is_used_as_given(patched):
    state = _state(3)
    _log(state, _config(log_memory_to_tensorboard=True), memory_report={"memory/mine": 4.0})
    patched.report.assert_not_called()
    patched.reduce.assert_not_called()
    state.wandb_logger.log.assert_any_call({"memory/mine": 4.0}, 3)


def test_interval_line_averages_advanced_losses_and_counts_nans(patched):
    state, config, totals = _state(4), _config(), {}
    _log(state, config, loss=float("nan"), skipped=1, totals=totals)
    for step, loss in ((4, 1.0), (5, 3.0)):
        state.train_state.step = step
        _log(state, config, loss=loss, totals=totals)
    line = patched.print_last.call_args[0][0]
    assert " iteration        5/     100 |" in line and " global batch size:    16 |" in line
    assert " lm loss: 2.000000E+00 |" in line
    assert "number of skipped iterations:   1 | number of nan iterations:   1 |" in line
    assert "elapsed time per iteration (ms): 666.7 |" in line  # 2 s over 3 iterations
    assert totals["advanced iterations"] == totals["nan iterations"] == 0
    assert totals["lm loss"].item() == 0.0


def test_memory_flag_kept_through_the_second_iteration_after_load(patched, mocker, capsys):
    mocker.patch("torch.distributed.get_rank", return_value=0)
    theoretical = mocker.patch(f"{TU}.report_theoretical_memory")
    config = _config(log_interval=1)
    assert _log(_state(11), config, report_memory_flag=True, loaded_iteration=10) is True
    assert _log(_state(12), config, report_memory_flag=True, loaded_iteration=10) is False
    assert theoretical.call_count == 2
    assert (
        "[Rank 0] (after 12 iterations) memory (GB) | mem-max-allocated-gigabytes: 1.5"
        in capsys.readouterr().out
    )


def _moe_model(**kw):
    defaults = dict(moe_router_load_balancing_type="aux_loss", moe_z_loss_coeff=1e-3)
    return SimpleNamespace(num_layers=4, num_moe_experts=8, moe_layer_freq=2, **(defaults | kw))


def _record_moe_step():
    """Two MoE layers (1 and 3 of 4) recorded over a step of two microbatches."""
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    tracker.record("load_balancing_loss", torch.tensor(0.4), 1, 4)
    tracker.record("load_balancing_loss", torch.tensor(0.8), 3, 4)
    tracker.record("z_loss", torch.tensor(0.2), 1, 4)
    return tracker


def test_track_moe_metrics_writes_the_layer_mean_and_accumulates_losses_as_upstream():
    tracker = _record_moe_step()
    writer, totals = mock.MagicMock(), {}
    text = track_moe_metrics(
        loss_scale=0.5,
        iteration=7,
        writer=writer,
        total_loss_dict=totals,
        per_layer_logging=True,
        track_names=["load_balancing_loss", "z_loss"],
        num_layers=4,
        moe_layer_freq=2,
        pg_collection=SimpleNamespace(pp=None, dp=None),  # one rank
    )
    # Summed over the step's microbatches x loss_scale, averaged over the 2 MoE layers.
    writer.add_scalar.assert_any_call("load_balancing_loss", pytest.approx(0.3), 7)
    writer.add_scalar.assert_any_call("z_loss", pytest.approx(0.05), 7)
    writer.add_scalar.assert_any_call("moe/load_balancing_loss_layer_2", pytest.approx(0.4), 7)
    assert totals["load_balancing_loss"].item() == pytest.approx(0.3)  # shown on the interval line
    assert text == "" and tracker.losses == {}  # losses leave the console text; the step is cleared


def test_track_moe_metrics_without_a_loss_dict_returns_the_console_text():
    _record_moe_step()
    text = track_moe_metrics(
        0.5, 1, track_names=["load_balancing_loss"], num_layers=4, moe_layer_freq=[1, 0, 1, 0],
        pg_collection=SimpleNamespace(pp=None, dp=None),
    )  # fmt: skip
    assert text == " load_balancing_loss: 0.30 |"


def test_training_log_tracks_moe_losses_when_the_loop_gave_no_report(patched, mocker):
    track = mocker.patch(f"{TU}.track_moe_metrics", return_value=" x: 1.00 |")
    config = _config()
    config.model = _moe_model(moe_router_load_balancing_type="seq_aux_loss")
    _log(_state(5, loggers=False), config)  # collective: on a rank without loggers too
    kwargs = track.call_args.kwargs
    # Upstream's substring tests: "seq_aux_loss" also names the plain load-balancing loss.
    assert kwargs["track_names"] == ["load_balancing_loss", "seq_load_balancing_loss", "z_loss"]
    assert kwargs["loss_scale"] == 1 / 4 and kwargs["num_layers"] == 4 and kwargs["moe_layer_freq"] == 2
    assert patched.print_last.call_args.args[0].endswith(" x: 1.00 |")


def test_training_log_uses_the_loops_moe_report_as_given(patched, mocker):
    track = mocker.patch(f"{TU}.track_moe_metrics")
    config, state = _config(), _state(5)
    config.model = _moe_model()
    _log(state, config, moe_report=({"load_balancing_loss": 0.3}, " load_balancing_loss: 0.30 |"))
    track.assert_not_called()
    state.tensorboard_logger.add_scalar.assert_any_call("load_balancing_loss", 0.3, 5)


def test_training_log_signature_is_upstreams():
    params = inspect.signature(training_log).parameters
    assert list(params)[:14] == [
        "loss_dict",
        "total_loss_dict",
        "learning_rate",
        "decoupled_learning_rate",
        "loss_scale",
        "report_memory_flag",
        "skipped_iter",
        "grad_norm",
        "params_norm",
        "num_zeros_in_grad",
        "config",
        "global_state",
        "history_wct",
        "model",
    ]
    for name in (
        "pg_collection",
        "log_max_attention_logit",
        "loaded_iteration",
        "seq_length",
        "memory_report",
    ):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_throughput_over_the_window(mocker):
    mocker.patch(f"{TU}.get_world_size_safe", return_value=4)
    cfg = SimpleNamespace(global_batch_size=8, micro_batch_size=2)
    assert report_throughput(cfg, 10, 32, [1.0, 2.0], window_size=3) == {}
    out = report_throughput(cfg, 10, 32, [1.0, 2.0, 3.0], window_size=3)
    assert out["throughput/samples_per_sec"] == 8.0 and out["throughput/device/tokens_per_sec"] == 64.0
    warn = mocker.patch(f"{TU}.print_rank_0")
    assert report_throughput(cfg, 10, 32, [3.0, 2.0, 3.0], window_size=3) == {}
    assert "elapsed_wct is 0.0" in warn.call_args[0][0]


def test_runtime_estimate_and_units(mocker):
    mocker.patch(f"{TU}.time.time", return_value=1000.0)
    ts = SimpleNamespace(step=25, consumed_train_samples=200)
    out = report_runtime(ts, start_time=880.0, seq_length=64, train_iters=100, time_unit="minutes")
    assert out["time/total"] == 2.0 and out["time/remaining_estimate"] == pytest.approx(6.0)
    assert out["time/tokens"] == 200 * 64 and out["time/batches"] == 25
    with pytest.raises(ValueError, match="Invalid time_unit: weeks"):
        report_runtime(ts, 0.0, 64, 100, time_unit="weeks")


def test_l2_norm_grad_per_parameter_and_global():
    model = torch.nn.Linear(2, 2)
    model.weight.main_grad = torch.full((2, 2), 3.0)
    model.bias.main_grad = torch.tensor([0.0, 4.0])
    out = report_l2_norm_grad([model])
    assert out == {
        "l2_norm/grad/weight": 6.0,
        "l2_norm/grad/bias": 4.0,
        "l2_norm/grad/global": pytest.approx(52**0.5),
    }


def _world_reductions(rank, world):
    """calc_params_l2_norm and the model-parallel reductions over one real two-rank group."""
    group = torch.distributed.new_group([0, 1])
    all_true = train_utils.logical_and_across_model_parallel_group(True, group)
    one_false = train_utils.logical_and_across_model_parallel_group(rank == 0, group)
    lr = train_utils.reduce_max_stat_across_model_parallel_group(2.0 if rank else None, group)
    none = train_utils.reduce_max_stat_across_model_parallel_group(None, group)
    model = torch.nn.Module()
    model.shard = torch.nn.Parameter(torch.full((3,), float(rank + 1)))  # TP shard: counts on each rank
    model.shard.tensor_model_parallel = True
    model.replica = torch.nn.Parameter(torch.full((4,), 2.0))  # replicated: counts once
    model.tied = torch.nn.Parameter(torch.full((5,), 7.0))
    model.tied.shared = True  # counted on the stage that owns it
    model.pg_collection = SimpleNamespace(
        tp=group, expt_tp=group, mp=group, dp_cp=group, expt_dp=group, tp_ep_pp=group
    )
    return calc_params_l2_norm(model, SimpleNamespace(bf16=False)), (all_true, one_false, lr, none)


@pytest.mark.world
def test_params_norm_and_model_parallel_reductions_over_a_real_group():
    """Each parameter counts once over the TP ranks; None learning rates are absent from the max."""
    expected = math.sqrt(3 * 1 + 3 * 4 + 4 * 4)
    assert run_world(_world_reductions, 2) == [(pytest.approx(expected), (True, False, 2.0, None))] * 2


def _expert_parallel_norm(rank, world):
    """Two ranks of one data-parallel pair that split the experts (ep=2): the dense weight is the same
    on both, each rank holds different experts."""
    from megatron_lite.core import parallel_state as ps
    from megatron_lite.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model = torch.nn.Module()
    model.dense = torch.nn.Parameter(torch.full((4,), 2.0))  # replicated over dp: counts once
    model.expert = torch.nn.Parameter(torch.full((3,), float(rank + 1)))  # this rank's experts
    model.expert.allreduce = False
    model.pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    try:
        return calc_params_l2_norm(model, SimpleNamespace(bf16=False))
    finally:
        ps.destroy_model_parallel()


@pytest.mark.world
def test_params_norm_sums_expert_parameters_over_the_expert_parallel_ranks():
    expected = math.sqrt(4 * 4 + 3 * 1 + 3 * 4)
    assert run_world(_expert_parallel_norm, 2) == [pytest.approx(expected)] * 2


def test_bf16_norm_prefers_the_fp32_master():
    model = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    model.weight.main_param = torch.tensor([[3.0, 4.0]])
    group = SimpleNamespace(tp=None, expt_tp=None, mp=None, dp_cp=None, expt_dp=None, tp_ep_pp=None)
    with (
        mock.patch(f"{TU}.get_pg_collection", return_value=group),
        mock.patch("torch.distributed.all_reduce"),
        mock.patch("torch.distributed.get_process_group_ranks", return_value=[0]),
    ):
        assert calc_params_l2_norm(model, SimpleNamespace(bf16=True)) == 5.0
        assert calc_params_l2_norm(model, SimpleNamespace(bf16=True), force_create_fp32_copy=True) != 5.0
    assert param_is_not_shared(model.weight)


def test_forward_step_injection():
    class State:
        pass

    def with_state(state, data_iterator, model):
        return state

    def annotated(data_iterator, model, s: GlobalState):  # noqa: F821 (a string: future annotations)
        return s

    def plain(data_iterator, model):
        return model

    state = State()
    assert needs_global_state_injection(with_state) and needs_global_state_injection(annotated)
    assert not needs_global_state_injection(plain)
    assert prepare_forward_step_func(with_state, state)(None, None) is state
    assert prepare_forward_step_func(plain, state) is plain
    assert maybe_inject_state(plain, state, needs_injection=True).args == (state,)


def test_constant_microbatch_calculator():
    nmc.reconfigure_num_microbatches_calculator(0, None, 32, 2, 4)
    assert nmc.get_num_microbatches() == 4 and nmc.get_current_global_batch_size() == 32
    with pytest.raises(ValueError, match="rampup_batch_size"):
        nmc.reconfigure_num_microbatches_calculator(0, [4, 4, 100], 32, 2, 4)
    with pytest.raises(ValueError, match="not divisible"):
        nmc.reconfigure_num_microbatches_calculator(0, None, 30, 2, 4)
    nmc.unset_num_microbatches_calculator()
    with pytest.raises(AssertionError):
        nmc.get_num_microbatches()
