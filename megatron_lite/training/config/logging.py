"""The logging section (console, TensorBoard, W&B, MLflow, Comet), Megatron-Bridge's LoggerConfig."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

from megatron_lite.training.errors import ConfigError, MissingPackageError


@dataclass(kw_only=True)
class LoggerConfig:
    """Console, TensorBoard, W&B, MLflow and Comet logging."""

    log_interval: int = 100
    """Iterations between console iteration lines."""
    log_throughput: bool = False
    """Print and log tokens/s."""
    log_params_norm: bool = False
    """Compute and log the parameter norm."""
    log_throughput_to_tensorboard: bool = False
    """Also write throughput to the loggers."""
    throughput_window_size: int = 100
    """Iterations averaged into the logged throughput."""
    log_l2_norm_grad_to_tensorboard: bool = False
    """Write the L2 norm of the gradients to the loggers."""
    log_runtime_to_tensorboard: bool = False
    """Write the elapsed and estimated remaining time to the loggers."""
    runtime_time_unit: str = "hours"
    """Unit of the logged runtime: seconds, minutes, hours or days."""
    log_world_size_to_tensorboard: bool = False
    """Write the world size to the loggers."""
    log_validation_ppl_to_tensorboard: bool = False
    """Write the validation perplexity to the loggers, beside the validation loss."""
    timing_log_level: Literal[-1, 0, 1, 2] = 0
    """Timers up to this level are started (0: iteration time only)."""
    timing_log_option: str = "minmax"
    """How timers are reduced over ranks: max, minmax or all."""
    tensorboard_dir: str | None = None
    """Where TensorBoard event files go (written by the last rank only)."""
    tensorboard_log_interval: int = 1
    """Iterations between TensorBoard / W&B / MLflow / Comet writes."""
    tensorboard_queue_size: int = 1000
    """Events buffered by SummaryWriter before a flush."""
    log_timers_to_tensorboard: bool = False
    """Write iteration timers to the loggers."""
    log_loss_scale_to_tensorboard: bool = True
    """Write the loss scale to the loggers."""
    log_memory_to_tensorboard: bool = False
    """Write memory statistics (the pipeline-wide peak of each) to the loggers."""
    log_memory_per_pp_stage: bool = False
    """Also write memory/pp-stage-<i>/<name> for every pipeline stage (megatron_lite's addition)."""
    memory_keys: dict[str, str] | None = None
    """memory_stats key -> logged name; None means train_utils.MEMORY_KEYS."""
    wandb_project: str | None = None
    """W&B project; enables W&B logging."""
    wandb_exp_name: str | None = None
    """W&B run name (required with wandb_project)."""
    wandb_save_dir: str | None = None
    """Local directory for W&B files."""
    wandb_entity: str | None = None
    """W&B entity (team or user)."""
    mlflow_experiment: str | None = None
    """MLflow experiment; enables MLflow logging."""
    mlflow_run_name: str | None = None
    """MLflow run name (required with mlflow_experiment)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (e.g. file:/path/mlruns); None means MLflow's default."""
    mlflow_tags: dict[str, str] | None = None
    """Tags set on the MLflow run."""
    comet_project: str | None = None
    """Comet project; enables Comet logging."""
    comet_experiment_name: str | None = None
    """Comet experiment name (required with comet_project)."""
    comet_workspace: str | None = None
    """Comet workspace."""
    comet_api_key: str | None = None
    """Comet API key (else the COMET_API_KEY environment variable)."""
    comet_tags: list[str] | None = None
    """Tags added to the Comet experiment."""
    comet_offline_directory: str | None = None
    """Write Comet experiments offline into this directory instead of uploading."""
    logging_level: int | None = None
    """Python logging level; None means INFO."""

    def finalize(self) -> None:
        """Check the named-run pairs and that each configured logger's package imports."""
        for project, name, label, flag in (
            (self.mlflow_experiment, self.mlflow_run_name, "mlflow_run_name", "--mlflow-run-name"),
            (
                self.comet_project,
                self.comet_experiment_name,
                "comet_experiment_name",
                "--comet-experiment-name",
            ),
        ):
            if project and not name:
                kind = "MLFlow" if label.startswith("mlflow") else "Comet ML"
                raise ConfigError(
                    flag, f"Set logger.{label} when enabling {kind} logging; give the run a name"
                )
        mlflow = (self.mlflow_experiment, self.mlflow_run_name, self.mlflow_tracking_uri, self.mlflow_tags)
        comet = (
            self.comet_project,
            self.comet_experiment_name,
            self.comet_workspace,
            self.comet_api_key,
            self.comet_tags,
        )
        for used, package, flag, extra in (
            (any(mlflow), "mlflow", "--mlflow-experiment", "mlflow"),
            (any(comet), "comet_ml", "--comet-project", "comet"),
        ):
            if not used:
                continue
            try:
                importlib.import_module(package)
            except ModuleNotFoundError as exc:
                raise MissingPackageError(
                    flag, f"needs the '{package}' package: pip install 'megatron_lite[{extra}]'"
                ) from exc
