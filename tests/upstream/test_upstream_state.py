"""GlobalState / TrainState / Timers / DistributedSignalHandler with Megatron-Bridge's surface: mocked
sinks where a real one cannot run here, a real gloo world where the collectives matter."""

from __future__ import annotations

import io
import os
import signal
import sys
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest
import torch
from dist_helpers import run_world

from megatron_lite.core.timers import DummyTimer, Timer, Timers
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.state import (
    GlobalState,
    TrainState,
    _timers_write_to_comet,
    _timers_write_to_mlflow,
    _timers_write_to_wandb,
)
from megatron_lite.training.utils.sig_utils import DistributedSignalHandler


@pytest.fixture
def keep_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def last_rank(mocker):
    """Pretend to be rank 3 of 4 (the writer rank)."""
    mocker.patch("megatron_lite.training.state.get_rank_safe", return_value=3)
    mocker.patch("megatron_lite.training.state.get_world_size_safe", return_value=4)


# --- TrainState -------------------------------------------------------------------------------------


def test_train_state_checkpoints_as_tensors_and_round_trips_exactly(tmp_path):
    big = 2**53 + 1  # beyond float64's exact integers: must travel as int64
    state = TrainState(step=big, consumed_train_samples=big * 8, floating_point_operations_so_far=1.5e21)
    state.do_test = True
    sd = state.state_dict()
    assert {k: v.dtype for k, v in sd.items()} == {
        "step": torch.int64,
        "consumed_train_samples": torch.int64,
        "skipped_train_samples": torch.int64,
        "consumed_valid_samples": torch.int64,
        "floating_point_operations_so_far": torch.float64,
        "do_train": torch.bool,
        "do_valid": torch.bool,
        "do_test": torch.bool,
    }
    torch.save(sd, tmp_path / "ts.pt")
    restored = TrainState()
    restored.load_state_dict(torch.load(tmp_path / "ts.pt"))
    assert restored == state
    assert type(restored.step) is int and type(restored.do_test) is bool


def test_train_state_defaults_as_upstream():
    assert TrainState() == TrainState(0, 0, 0, 0, 0, False, False, False)


def test_load_state_dict_needs_every_field():
    with pytest.raises(KeyError):
        TrainState().load_state_dict({"step": torch.tensor(1)})


# --- GlobalState: construction, cfg, lazy parts -------------------------------------------------------


def test_global_state_builds_nothing_until_asked():
    state = GlobalState()
    assert state.cfg is None and state._timers is None and state._train_state is None
    assert state._signal_handler is None and state.async_calls_queue is None
    state.train_state.step = 5
    state.__init__()  # a second __init__ keeps what is there
    assert state.train_state.step == 5


def test_timers_follow_the_logger_config():
    cfg = ConfigContainer()
    cfg.logger.timing_log_level = 1
    state = GlobalState(cfg)
    timers = state.timers
    assert timers is state.timers  # created once
    assert isinstance(timers("not-timed", log_level=2), DummyTimer)  # above level 1
    assert isinstance(timers("timed", log_level=1), Timer)
    assert (
        callable(timers.write_to_wandb)
        and callable(timers.write_to_mlflow)
        and callable(timers.write_to_comet)
    )


def test_cfg_setter_installs_the_sigterm_trap_only_when_asked(keep_sigterm):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    off = GlobalState()
    off.cfg = ConfigContainer()
    assert off.signal_handler is None and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    cfg = ConfigContainer()
    cfg.train.exit_signal_handler = True
    on = GlobalState()
    on.cfg = cfg
    os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
    assert on.signal_handler._signal_received is True
    assert on.signal_handler.signals_received() == [True]  # no process group: this rank only
    on.reset_for_restart()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and on._signal_handler is None


def test_signal_handler_release_is_idempotent(keep_sigterm):
    handler = DistributedSignalHandler(signal.SIGUSR1)
    with handler:
        assert signal.getsignal(signal.SIGUSR1) == handler._handle
    assert handler.released and handler.release() is False


def test_unsupported_features_stay_off():
    state = GlobalState()
    state.cfg = SimpleNamespace(train=None, logger=SimpleNamespace(log_energy=True), nvrx_straggler=object())
    with pytest.raises(NotImplementedError, match="energy"):
        _ = state.energy_monitor
    with pytest.raises(NotImplementedError, match="NVRx"):
        _ = state.nvrx_straggler_manager
    state.cfg = SimpleNamespace(train=None, logger=SimpleNamespace(log_energy=False), nvrx_straggler=None)
    assert state.energy_monitor is None and state.nvrx_straggler_manager is None


# --- loggers: last rank only, upstream's calls, our resume/offline behaviour ---------------------------------


def test_tensorboard_purges_past_the_resumed_step(mocker, last_rank):
    writer = mocker.patch("torch.utils.tensorboard.writer.SummaryWriter")
    cfg = ConfigContainer()
    cfg.logger.tensorboard_dir = "/tmp/tb-never-written"
    fresh = GlobalState(cfg)
    assert fresh.tensorboard_logger is writer.return_value
    writer.assert_called_once_with(log_dir="/tmp/tb-never-written", max_queue=1000)
    resumed = GlobalState(cfg)
    resumed.train_state.step = 7
    _ = resumed.tensorboard_logger
    assert writer.call_args.kwargs["purge_step"] == 8
    resumed.reset_for_restart()
    writer.return_value.close.assert_called()
    assert resumed._tensorboard_logger is None


def test_loggers_exist_on_the_last_rank_only(mocker):
    mocker.patch("megatron_lite.training.state.get_rank_safe", return_value=0)
    mocker.patch("megatron_lite.training.state.get_world_size_safe", return_value=2)
    writer = mocker.patch("torch.utils.tensorboard.writer.SummaryWriter")
    cfg = ConfigContainer()
    cfg.logger.tensorboard_dir, cfg.logger.wandb_project, cfg.logger.wandb_exp_name = "/tmp/x", "p", "e"
    state = GlobalState(cfg)
    assert (state.tensorboard_logger, state.wandb_logger, state.mlflow_logger, state.comet_logger) == (
        None,
    ) * 4
    writer.assert_not_called()


def test_wandb_logger_is_the_module_with_a_run(mocker, last_rank, tmp_path, restored_environment):
    # The factory sets W&B's console defaults in this process, as on the writer rank.
    fake = mocker.MagicMock()
    mocker.patch.dict(sys.modules, {"wandb": fake})
    cfg = ConfigContainer()
    cfg.logger.wandb_project, cfg.logger.wandb_exp_name = "proj", "run-1"
    cfg.checkpoint.save = str(tmp_path / "ckpt")
    state = GlobalState(cfg)
    assert state.wandb_logger is fake
    kwargs = fake.init.call_args.kwargs
    assert kwargs["dir"] == str(tmp_path / "ckpt" / "wandb") and os.path.isdir(kwargs["dir"])
    assert kwargs["name"] == "run-1" and kwargs["config"]["train"]["global_batch_size"] == 16
    state.close_loggers(success=False)
    fake.finish.assert_called_once_with(exit_code=1)


def test_wandb_empty_name_is_refused_in_one_line(last_rank):
    cfg = ConfigContainer()
    cfg.logger.wandb_project, cfg.logger.wandb_exp_name = "proj", ""
    with pytest.raises(ValueError, match="wandb experiment name"):
        _ = GlobalState(cfg).wandb_logger


def test_mlflow_starts_a_run_and_logs_flat_params(mocker, last_rank):
    fake = mocker.MagicMock()
    fake.active_run.return_value = None
    mocker.patch.dict(sys.modules, {"mlflow": fake})
    cfg = ConfigContainer()
    cfg.logger.mlflow_experiment, cfg.logger.mlflow_run_name = "exp", "run"
    cfg.logger.mlflow_tags = {"team": "lm"}
    state = GlobalState(cfg)
    assert state.mlflow_logger is fake
    fake.set_experiment.assert_called_once_with("exp")
    assert fake.start_run.call_args.kwargs["tags"] == {"team": "lm"}
    params = fake.log_params.call_args.args[0]
    assert params["train.global_batch_size"] == 16 and params["logger.mlflow_experiment"] == "exp"
    assert all(isinstance(v, (int, float, bool, str)) or v is None for v in params.values())
    state.close_loggers()
    fake.end_run.assert_called_once_with(status="FINISHED")


def test_mlflow_joins_an_active_run(mocker, last_rank):
    fake = mocker.MagicMock()
    mocker.patch.dict(sys.modules, {"mlflow": fake})
    cfg = ConfigContainer()
    cfg.logger.mlflow_experiment, cfg.logger.mlflow_run_name = "exp", "run"
    cfg.logger.mlflow_tags = {"team": "lm"}
    _ = GlobalState(cfg).mlflow_logger
    fake.start_run.assert_not_called()
    fake.set_tags.assert_called_once_with({"team": "lm"})


def test_comet_offline_directory_gives_an_offline_experiment(mocker, last_rank, tmp_path):
    fake = mocker.MagicMock()
    mocker.patch.dict(sys.modules, {"comet_ml": fake})
    cfg = ConfigContainer()
    cfg.logger.comet_project, cfg.logger.comet_experiment_name = "proj", "exp"
    cfg.logger.comet_offline_directory = str(tmp_path / "comet")
    experiment = GlobalState(cfg).comet_logger
    assert experiment is fake.OfflineExperiment.return_value
    fake.Experiment.assert_not_called()
    experiment.set_name.assert_called_once_with("exp")
    assert fake.OfflineExperiment.call_args.kwargs["auto_metric_logging"] is False


# --- Timers -----------------------------------------------------------------------------------------------


def test_timer_accumulates_and_refuses_misuse():
    timers = Timers(1, "minmax")
    t = timers("step", log_level=1)
    with pytest.raises(AssertionError):
        t.stop()
    t.set_elapsed(0.25)
    assert t.elapsed(reset=False) == 0.25 and t.elapsed() == 0.25 and t.elapsed() == 0.0
    t.start()
    with pytest.raises(AssertionError):
        t.start()
    assert t.elapsed() >= 0.0 and t._started  # reading a running timer keeps it running
    with pytest.raises(AssertionError, match="log level"):
        timers("step", log_level=0)
    with pytest.raises(AssertionError):
        Timers(1, "median")
    with pytest.raises(Exception, match="log level"):
        timers("verbose").elapsed()  # no level means the maximum, 2: a dummy here


def test_timers_log_and_write_single_process():
    timers = Timers(2, "max")
    timers("a", log_level=0).set_elapsed(0.5)
    timers("b", log_level=0).set_elapsed(0.0)  # never ran: left out
    out = io.StringIO()
    with redirect_stdout(out):
        timers.log(["a", "b"], reset=False)
    assert "max time across ranks (ms):" in out.getvalue() and "500.00" in out.getvalue()
    assert "b " not in out.getvalue()

    class Board:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, name, value, step):
            self.scalars.append((name, value, step))

    board = Board()
    timers.write(["a", "b"], board, 3, normalizer=2.0)
    assert board.scalars == [("a-time", 0.25, 3)]
    assert timers("a").elapsed() == 0.0  # write reset it


def test_timer_sink_helpers_use_the_max_and_each_sinks_key_rules(mocker):
    timers = mocker.MagicMock()
    timers._get_global_min_max_time.return_value = {"fwd/bwd": (0.1, 0.4)}
    sink = mocker.MagicMock()
    _timers_write_to_mlflow(timers, ["fwd/bwd"], sink, 9)
    sink.log_metrics.assert_called_once_with({"fwd_bwd-time": 0.4}, step=9)
    sink.reset_mock()
    _timers_write_to_comet(timers, ["fwd/bwd"], sink, 9, normalizer=4.0, reset=False, barrier=True)
    sink.log_metrics.assert_called_once_with({"fwd/bwd-time": 0.4}, step=9)
    timers._get_global_min_max_time.assert_called_with(["fwd/bwd"], False, True, 4.0)
    _timers_write_to_wandb(timers, ["fwd/bwd"], sink, 9)
    sink.log.assert_called_once_with({"fwd/bwd-time": 0.4}, 9)
    sink.log_metrics.side_effect = RuntimeError("server down")
    with pytest.warns(UserWarning, match="MLFlow"):
        _timers_write_to_mlflow(timers, ["fwd/bwd"], sink, 10)
    with pytest.raises(AssertionError):
        _timers_write_to_comet(timers, ["fwd/bwd"], sink, 10, normalizer=0.0)


def _world(rank, world):
    timers = Timers(1, "minmax")
    timers("fwd", log_level=0).set_elapsed(0.1 * (rank + 1))
    if rank == 0:
        timers("only-rank-0", log_level=0).set_elapsed(0.3)
    min_max = timers._get_global_min_max_time(["fwd", "only-rank-0", "missing"], False, True, 1.0)
    out = io.StringIO()
    with redirect_stdout(out):
        timers.log(["fwd"], reset=False)
    all_ranks = Timers(1, "all")
    all_ranks("fwd", log_level=0).set_elapsed(1.0 + rank)
    per_rank = all_ranks.get_all_timers_string(["fwd"])
    handler = DistributedSignalHandler(signal.SIGUSR1)
    with handler:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        received = handler.signals_received()
    return min_max, out.getvalue(), per_rank, received


@pytest.mark.world
def test_timers_and_signals_agree_across_a_real_world():
    results = run_world(_world, 2)
    for min_max, _, per_rank, received in results:
        assert min_max["fwd"] == pytest.approx((0.1, 0.2))
        assert min_max["only-rank-0"] == pytest.approx((0.3, 0.3))  # ranks without it do not count
        assert "missing" not in min_max
        assert "rank  0: 1000.00" in per_rank and "rank  1: 2000.00" in per_rank
        assert received == [False, True]
    assert results[0][1] == ""  # log prints on the last rank only
    assert "(min, max) time across ranks (ms):" in results[1][1] and "(100.00, 200.00)" in results[1][1]
