"""The logging, checkpoint, launch, seed, rerun and profiling sections of ConfigContainer.

Names and defaults are Megatron-Bridge's (``megatron.bridge.training.config``) for what megatron_lite
runs; ``finalize()`` checks a section on its own and may run more than once. Fields of features not
built yet keep upstream's name and default, and ConfigContainer.validate refuses any other value.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Literal

from megatron_lite.training.config_errors import ConfigError, MissingPackageError, require


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


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and loading, in Megatron's legacy torch format (``ckpt_format="torch"``)."""

    save: str | None = None
    """Directory to save checkpoints into."""
    save_interval: int | None = None
    """Iterations between saves."""
    save_optim: bool = True
    """Save optimizer and scheduler state (not saving them is not supported yet: True)."""
    save_rng: bool = True
    """Save RNG state (not saving it is not supported yet: True)."""
    load: str | None = None
    """Directory to resume from; missing or empty starts fresh."""
    load_optim: bool = True
    """Load optimizer and scheduler state (--no-load-optim turns off)."""
    load_main_params_from_ckpt: bool = False
    """Load fp32 main parameters from the checkpoint (not supported yet: False)."""
    load_rng: bool = True
    """Load RNG state (--no-load-rng turns off)."""
    finetune: bool = False
    """Load weights only and reset the iteration count."""
    pretrained_checkpoint: str | None = None
    """Separate checkpoint to finetune from (not supported yet: use load with finetune)."""
    ckpt_step: int | None = None
    """Load this iteration instead of the latest (not supported yet: None)."""
    ckpt_format: str = "torch"
    """Checkpoint format: megatron_lite reads and writes Megatron's legacy ``torch`` format."""
    async_save: bool = False
    """Save in the background (not supported yet: False)."""
    use_persistent_ckpt_worker: bool = True
    """Keep one background worker for async saves."""

    def finalize(self) -> None:
        if self.load_main_params_from_ckpt:
            require(
                not self.load_optim,
                "--load-main-params-from-ckpt",
                "load_main_params_from_ckpt must be used with load_optim=False",
            )
        if self.async_save:
            require(
                self.save is not None,
                "--async-save",
                "async_save is enabled, but save is not set. Set save to a valid path.",
            )
        if self.ckpt_step is not None and self.load is None:
            raise ConfigError(
                "--ckpt-step", f"ckpt_step={self.ckpt_step} specified but checkpoint.load is None; set --load"
            )


@dataclass(kw_only=True)
class DistributedInitConfig:
    """Process launch and backend."""

    nproc_per_node: int | None = None
    """Workers pretrain.py starts on this machine (megatron_lite's launcher); None means the
    torchrun world when launched by torchrun, else tp x pp x cp."""
    distributed_backend: str | None = None
    """nccl or gloo; None picks nccl with GPUs, gloo without (upstream's default is nccl)."""
    distributed_timeout_minutes: int = 10
    """Timeout of collectives."""
    align_grad_reduce: bool = True
    """Start gradient reductions of all pipeline stages together."""
    local_rank: int = field(default_factory=lambda: int(os.getenv("LOCAL_RANK", "0")))
    """This process's rank on its node."""
    lazy_mpu_init: bool = False
    """Defer model-parallel initialisation (implies CPU initialisation of the model)."""
    use_gloo_process_groups: bool = True
    """Also build gloo copies of the data-parallel groups."""
    use_megatron_fsdp: bool = False
    """Megatron FSDP (not supported: False)."""
    use_torch_fsdp2: bool = False
    """PyTorch FSDP2 (not supported: False)."""
    use_tp_pp_dp_mapping: bool = False
    """Rank order tp-pp-dp instead of tp-cp-ep-dp-pp (not supported yet: False)."""
    use_decentralized_pg: bool = False
    """Pass process groups explicitly instead of through parallel_state (not supported yet: False)."""
    eval_context_parallel_size: int | None = None
    """A different context-parallel size for validation (not supported yet: None)."""

    @property
    def lazy_init(self) -> bool:
        return self.lazy_mpu_init

    @lazy_init.setter
    def lazy_init(self, value: bool) -> None:
        self.lazy_mpu_init = value


@dataclass(kw_only=True)
class RNGConfig:
    """Random seeds."""

    seed: int = 1234
    """Seed for initialisation, dropout and data."""
    te_rng_tracker: bool = False
    """Transformer Engine's RNG tracker (not supported: False)."""
    inference_rng_tracker: bool = False
    """A separate RNG tracker for inference (not supported: False)."""
    data_parallel_random_init: bool = False
    """Different initial weights per data-parallel rank (not supported: False)."""


@dataclass(kw_only=True)
class RerunStateMachineConfig:
    """Result validation by re-running iterations; megatron_lite only checks the loss for NaN."""

    error_injection_rate: int = 0
    """Inject an error every this many iterations (not supported: 0)."""
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = "transient_error"
    """Kind of error injected."""
    rerun_mode: Literal["disabled", "validate_results", "report_determinism_stats"] = "disabled"
    """Re-run engine mode (only disabled is supported)."""
    check_for_nan_in_loss: bool = True
    """Skip the optimizer step of an iteration whose loss is NaN or infinite."""
    check_for_spiky_loss: bool = False
    """Detect spiky losses (not supported: False)."""
    spiky_loss_factor: float = 10.0
    """A loss above this multiple of the window's maximum is spiky."""


@dataclass(kw_only=True)
class ProfilingConfig:
    """Profiler settings: torch.profiler traces per rank, or Nsight Systems ranges on CUDA."""

    use_nsys_profiler: bool = False
    """Nsight Systems: start CUDA's profiler at profile_step_start (``--profile``; needs CUDA)."""
    profile_step_start: int = 10
    """Global step to start profiling."""
    profile_step_end: int = 12
    """Global step to stop profiling."""
    use_pytorch_profiler: bool = False
    """torch.profiler: one Chrome trace per profiled rank under <tensorboard_dir>/../torch_profile."""
    pytorch_profiler_collect_shapes: bool = False
    """Record tensor shapes in the torch profiler's trace."""
    pytorch_profiler_collect_callstack: bool = False
    """Record Python call stacks in the torch profiler's trace."""
    pytorch_profiler_collect_chakra: bool = False
    """Chakra execution traces (not supported yet)."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks to profile; empty means every rank."""
    record_shapes: bool = False
    """Record tensor shapes in the NVTX ranges of the Nsight Systems profiler."""
    record_memory_history: bool = False
    """Record the CUDA allocator's history on every rank; the last rank writes a snapshot at every log
    interval, a rank that runs out of memory its own (CUDA only)."""
    memory_snapshot_path: str = "snapshot.pickle"
    """Where the last rank writes the memory history snapshot (pickle; open it at pytorch.org/memory_viz)."""

    def finalize(self) -> None:
        require(
            not (self.use_pytorch_profiler and self.use_nsys_profiler),
            "profiling",
            "Exactly one of pytorch or nsys profiler should be enabled, not both",
        )
        require(
            self.profile_step_end >= self.profile_step_start,
            "profiling",
            f"profile_step_end ({self.profile_step_end}) must be >= profile_step_start ({self.profile_step_start})",
        )
        # torch.profiler records steps start .. end - 1: start == end would record none (and it refuses).
        require(
            not self.use_pytorch_profiler or self.profile_step_end > self.profile_step_start,
            "--profile-step-end",
            f"must exceed --profile-step-start ({self.profile_step_start}) with --use-pytorch-profiler",
        )
