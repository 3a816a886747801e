"""GlobalState: the run's config, progress, timers, SIGTERM trap and (lazily, on the last rank only)
its loggers, with Megatron-Bridge's attribute names.

Features this project does not have (fault tolerance, straggler detection, async checkpoint saves,
energy monitoring, tokenizers) keep upstream's private attributes, always None, so code that checks
them runs unchanged. ``async_calls_queue``, ``energy_monitor`` and ``nvrx_straggler_manager`` answer
None; the latter two raise NotImplementedError when the config asks for the feature.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
import types
from typing import Any

import torch.distributed as dist

from megatron_lite.core.timers import Timers
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.metrics.timers import (  # upstream defines these here: importable from state
    _timers_write_to_comet,
    _timers_write_to_mlflow,
    _timers_write_to_wandb,
)
from megatron_lite.training.train_state import TrainState
from megatron_lite.training.utils import logger_factories
from megatron_lite.training.utils.sig_utils import DistributedSignalHandler
from megatron_lite.utils.common_utils import get_rank_safe, get_world_size_safe

# Hooks the training loop installs on the model config; a restarted run must install fresh ones.
_MODEL_CONFIG_CALLBACKS = (
    "finalize_model_grads_func",
    "grad_scale_func",
    "no_sync_func",
    "grad_sync_func",
    "param_sync_func",
)


class LoggerStartupError(RuntimeError):
    """A logger could not be created; ``str(err)`` is the one line shown to the user."""


def _is_writer_rank() -> bool:
    """Loggers live on the last rank, as upstream: rank world_size - 1 (the last pipeline stage)."""
    return get_rank_safe() == get_world_size_safe() - 1


def _not_supported(feature: str) -> NotImplementedError:
    return NotImplementedError(f"{feature} is not supported by megatron_lite")


class GlobalState:
    """Everything a run shares; each part is created on first access.

    Loggers are created on rank world_size - 1 only (None elsewhere). Logger settings are validated
    by ConfigContainer.validate on every rank before any collective, and :meth:`start_loggers` creates
    them at start-up, so a bad setting never fails on one rank while the others wait.
    """

    def __init__(self, cfg: ConfigContainer | None = None) -> None:
        """``GlobalState()`` as upstream, then set ``.cfg``; ``GlobalState(cfg)`` does both at once."""
        if getattr(self, "_initialized", False):  # a second __init__ keeps the live state
            return
        self._initialized = True
        self._cfg: ConfigContainer | None = None
        self._tokenizer = None
        self._tensorboard_logger = None
        self._wandb_logger = None
        self._mlflow_logger = None
        self._comet_logger = None
        self._timers: Timers | None = None
        self._train_state: TrainState | None = None
        self._signal_handler: DistributedSignalHandler | None = None
        self.start_time: float = time.time()
        """Wall-clock time this state was created (the run's start)."""
        self.last_iteration_time = 0.0
        """Seconds the latest iteration took (for throughput)."""
        # Upstream features this project lacks: always None / False (see the module docstring).
        self.rank_monitor_client = None
        self._ft_state = None
        self._straggler_timer = None
        self._async_calls_queue = None
        self._nvrx_straggler_manager = None
        self._nvrx_straggler_created = False
        self._energy_monitor = None
        self._energy_monitor_created = False
        self._train_pgs = None
        self._eval_pgs = None
        if cfg is not None:
            self.cfg = cfg

    @property
    def cfg(self) -> ConfigContainer | None:
        """The run's configuration."""
        return self._cfg

    @cfg.setter
    def cfg(self, value: ConfigContainer | None) -> None:
        # The SIGTERM trap goes in as soon as the config says so, so a signal during setup counts too.
        self._cfg = value
        if value is not None:
            self._set_signal_handler()

    @property
    def train_state(self) -> TrainState:
        """Training progress (created empty on first access)."""
        if self._train_state is None:
            self._train_state = TrainState()
        return self._train_state

    @train_state.setter
    def train_state(self, value: TrainState) -> None:
        self._train_state = value

    @property
    def timers(self) -> Timers:
        """The run's Timers (logger.timing_log_level / timing_log_option), with ``write_to_wandb``,
        ``write_to_mlflow`` and ``write_to_comet`` beside Timers.write (TensorBoard)."""
        if self._timers is None:
            lg = self.cfg.logger
            self._timers = Timers(lg.timing_log_level, lg.timing_log_option)
            self._timers.write_to_wandb = types.MethodType(_timers_write_to_wandb, self._timers)
            self._timers.write_to_mlflow = types.MethodType(_timers_write_to_mlflow, self._timers)
            self._timers.write_to_comet = types.MethodType(_timers_write_to_comet, self._timers)
        return self._timers

    @property
    def signal_handler(self) -> DistributedSignalHandler | None:
        """The trap for train.exit_signal when train.exit_signal_handler is on, else None."""
        if self._signal_handler is None:
            self._set_signal_handler()
        return self._signal_handler

    def _set_signal_handler(self) -> None:
        train = self.cfg.train
        if train is not None and train.exit_signal_handler:
            sig = getattr(train, "exit_signal", signal.SIGTERM)
            self._signal_handler = DistributedSignalHandler(sig).__enter__()

    @property
    def tensorboard_logger(self):
        """A torch.utils.tensorboard SummaryWriter, or None."""
        lg = self.cfg.logger
        if self._tensorboard_logger is None and lg.tensorboard_dir and _is_writer_rank():
            self._tensorboard_logger = logger_factories.make_tensorboard_writer(lg, self.train_state.step)
        return self._tensorboard_logger

    @property
    def wandb_logger(self):
        """The ``wandb`` module with this run initialised, or None."""
        lg = self.cfg.logger
        if self._wandb_logger is None and lg.wandb_project and _is_writer_rank():
            if lg.wandb_exp_name == "":
                raise ValueError("Please specify the wandb experiment name!")
            self._wandb_logger = logger_factories.make_wandb(self.cfg, _sanitized_config(self.cfg))
        return self._wandb_logger

    @property
    def mlflow_logger(self):
        """The ``mlflow`` module with this run active, or None."""
        cfg = self.cfg
        if (
            self._mlflow_logger is None
            and cfg is not None
            and cfg.logger.mlflow_experiment
            and _is_writer_rank()
        ):
            if cfg.logger.mlflow_run_name == "":
                raise ValueError("Please specify the mlflow_run_name for MLFlow logging!")
            self._mlflow_logger = logger_factories.make_mlflow(cfg.logger, _sanitized_config(cfg))
        return self._mlflow_logger

    @property
    def comet_logger(self):
        """A comet_ml Experiment (offline when comet_offline_directory is set), or None."""
        cfg = self.cfg
        if self._comet_logger is None and cfg is not None and cfg.logger.comet_project and _is_writer_rank():
            if not cfg.logger.comet_experiment_name:
                raise ValueError("Please specify the comet_experiment_name for Comet ML logging!")
            self._comet_logger = logger_factories.make_comet(cfg.logger, _sanitized_config(cfg))
        return self._comet_logger

    @property
    def async_calls_queue(self) -> Any:
        """Upstream's queue of asynchronous checkpoint saves; always None (saves are synchronous)."""
        return self._async_calls_queue

    @property
    def nvrx_straggler_manager(self) -> Any:
        """None: NVRx straggler detection is not supported (cfg.nvrx_straggler must stay None)."""
        if self.cfg is not None and getattr(self.cfg, "nvrx_straggler", None) is not None:
            raise _not_supported("NVRx straggler detection")
        return self._nvrx_straggler_manager

    @property
    def energy_monitor(self) -> Any:
        """None: energy monitoring is not supported (logger.log_energy must stay off)."""
        if self.cfg is not None and getattr(self.cfg.logger, "log_energy", False):
            raise _not_supported("energy monitoring (logger.log_energy)")
        return self._energy_monitor

    def start_loggers(self) -> None:
        """Create this rank's loggers now, so a bad setting fails at start-up on every rank together
        instead of lazily on the writer while the others wait. Collective over the world."""
        error = None
        try:
            for name in ("tensorboard_logger", "wandb_logger", "mlflow_logger", "comet_logger"):
                getattr(self, name)
        except Exception as err:  # any sink's own error type
            error = f"could not start {name.split('_')[0]}: {type(err).__name__}: {str(err).splitlines()[0]}"
        errors = [error] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_gather_object(errors, error)
        if first := next((e for e in errors if e), None):
            raise LoggerStartupError(first)

    def close_loggers(self, success: bool = True) -> None:
        """Flush and close every logger that was created. Safe to call more than once."""
        if self._tensorboard_logger is not None:
            self._tensorboard_logger.flush()
            self._tensorboard_logger.close()
            self._tensorboard_logger = None
        if self._wandb_logger is not None:
            self._wandb_logger.finish(exit_code=0 if success else 1)
            self._wandb_logger = None
        if self._mlflow_logger is not None:
            self._mlflow_logger.end_run(status="FINISHED" if success else "FAILED")
            self._mlflow_logger = None
        if self._comet_logger is not None:
            self._comet_logger.end()
            self._comet_logger = None

    def reset_for_restart(self) -> None:
        """Drop everything a restarted run must build afresh (timers, progress, loggers, the signal
        trap), keeping the config. The TensorBoard writer is closed; other loggers are just forgotten."""
        if self.cfg is not None:
            # Callbacks the previous attempt installed on the model config point at its dead objects.
            model_config = getattr(self.cfg.model, "transformer", self.cfg.model)
            for name in _MODEL_CONFIG_CALLBACKS:
                if hasattr(model_config, name):
                    setattr(model_config, name, None)
        self._timers = None
        self._train_state = None
        if self._tensorboard_logger is not None:
            self._tensorboard_logger.close()
        self._tensorboard_logger = None
        self._wandb_logger = None
        self._mlflow_logger = None
        self._comet_logger = None
        self._energy_monitor = None
        self._energy_monitor_created = False
        if self._signal_handler is not None:
            self._signal_handler.release()
        self._signal_handler = None
        self._straggler_timer = None
        self._nvrx_straggler_manager = None
        self._nvrx_straggler_created = False


def _sanitized_config(cfg) -> dict:
    """The config as plain JSON values (anything else as its str), for the loggers' run parameters."""
    raw = cfg.to_dict() if hasattr(cfg, "to_dict") else dataclasses.asdict(cfg)
    return json.loads(json.dumps(raw, default=logger_factories.safe_serialize))
