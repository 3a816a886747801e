"""GlobalState: the run's config, progress, timers and (lazily, on the last rank only) its loggers."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch.distributed as dist

from megatron_lite.core.timers import Timers
from megatron_lite.training.config import ConfigContainer


@dataclass
class TrainState:
    """Training progress; checkpointed and restored exactly."""

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: int = 0
    do_train: bool = True
    do_valid: bool = False

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


class LoggerStartupError(RuntimeError):
    """A logger could not be created; ``str(err)`` is the one line shown to the user."""


def _is_writer_rank() -> bool:
    """Loggers live on the last rank, as upstream: rank world_size - 1 (the last pipeline stage)."""
    if not dist.is_initialized():
        return True
    return dist.get_rank() == dist.get_world_size() - 1


class GlobalState:
    """Each logger is created on first access, on rank world_size - 1 only; None elsewhere.

    Logger settings are validated by ConfigContainer.validate on every rank before any collective, so
    creating a logger here never fails on one rank while the others wait.
    """

    def __init__(self, cfg: ConfigContainer | None = None):
        self.cfg = cfg
        self.train_state = TrainState()
        self.timers = Timers()
        self.last_iteration_time = 0.0
        """Seconds the latest iteration took (for throughput)."""
        self._tensorboard_logger = None
        self._wandb_logger = None
        self._mlflow_logger = None
        self._comet_logger = None

    @property
    def tensorboard_logger(self):
        """A torch.utils.tensorboard.SummaryWriter, or None."""
        lg = self.cfg.logger
        if self._tensorboard_logger is None and lg.tensorboard_dir and _is_writer_rank():
            from torch.utils.tensorboard import SummaryWriter

            # On resume, drop events a crashed earlier run wrote past the checkpoint: no duplicate steps.
            purge_step = self.train_state.step + 1 if self.train_state.step > 0 else None
            self._tensorboard_logger = SummaryWriter(
                log_dir=lg.tensorboard_dir, max_queue=lg.tensorboard_queue_size, purge_step=purge_step
            )
        return self._tensorboard_logger

    @property
    def wandb_logger(self):
        """The W&B run (``wandb.init``), or None."""
        lg = self.cfg.logger
        if self._wandb_logger is None and lg.wandb_project and _is_writer_rank():
            import wandb

            save_dir = lg.wandb_save_dir or os.path.join(lg.tensorboard_dir or ".", "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self._wandb_logger = wandb.init(
                project=lg.wandb_project,
                name=lg.wandb_exp_name,
                entity=lg.wandb_entity,
                dir=save_dir,
                config=dataclasses.asdict(self.cfg),
                settings=wandb.Settings(console="off", silent=True),
            )
        return self._wandb_logger

    @property
    def mlflow_logger(self):
        """The ``mlflow`` module with this run active, or None."""
        lg = self.cfg.logger
        if self._mlflow_logger is None and lg.mlflow_experiment and _is_writer_rank():
            import mlflow

            if lg.mlflow_tracking_uri:
                if lg.mlflow_tracking_uri.startswith("file:") or "://" not in lg.mlflow_tracking_uri:
                    # Asking for a file store is asking for it: MLflow 3 otherwise refuses one.
                    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                mlflow.set_tracking_uri(lg.mlflow_tracking_uri)
            mlflow.set_experiment(lg.mlflow_experiment)
            mlflow.start_run(run_name=lg.mlflow_run_name)
            self._mlflow_logger = mlflow
        return self._mlflow_logger

    @property
    def comet_logger(self):
        """A comet_ml Experiment (offline when comet_offline_directory is set), or None."""
        lg = self.cfg.logger
        if self._comet_logger is None and lg.comet_project and _is_writer_rank():
            import comet_ml

            common = {
                "project_name": lg.comet_project,
                "workspace": lg.comet_workspace,
                "auto_output_logging": False,
                "log_env_details": False,
                "log_git_metadata": False,
                "log_git_patch": False,
                "log_env_gpu": False,
                "log_env_host": False,
                "display_summary_level": 0,
            }
            if lg.comet_offline_directory:
                os.makedirs(lg.comet_offline_directory, exist_ok=True)
                experiment = comet_ml.OfflineExperiment(
                    offline_directory=lg.comet_offline_directory, **common
                )
            else:
                experiment = comet_ml.Experiment(**common)
            experiment.set_name(lg.comet_experiment_name)
            self._comet_logger = experiment
        return self._comet_logger

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
