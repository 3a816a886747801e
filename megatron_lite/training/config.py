"""ConfigContainer: the whole run's configuration as typed sections, validated in one place.

Sections mirror Megatron-Bridge (``model``, ``train``, ``optimizer``, ``scheduler``, ``dataset``,
``logger``, ``checkpoint``, ``dist``, ``rng``). :meth:`ConfigContainer.validate` runs on every rank,
before any collective, and in the launcher before any worker starts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from megatron_lite.core.optimizer.optimizer_config import OptimizerConfig
from megatron_lite.models.gpt_provider import GPTModelProvider


class ConfigError(ValueError):
    """Bad user input. ``str(err)`` is the one line shown to the user: the flag and the fix."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes and loop length."""

    micro_batch_size: int = 2
    """Samples per microbatch on one data-parallel rank."""
    global_batch_size: int = 16
    """Samples per iteration across all data-parallel ranks and microbatches."""
    train_iters: int = 100
    """Iterations to train (the default demo: about a minute on two CPU cores)."""
    exit_interval: int | None = None
    """Stop (after saving, when --save is set) once the iteration is a multiple of this."""
    exit_signal_handler: bool = False
    """On SIGTERM, finish the current iteration, save a checkpoint and exit 0."""
    eval_interval: int | None = None
    """Run validation every this many iterations (None: never)."""
    eval_iters: int = 10
    """Validation iterations per evaluation."""


@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate schedule, Megatron's OptimizerParamScheduler semantics."""

    lr_decay_style: str = "linear"
    """constant, linear or cosine."""
    lr_decay_iters: int | None = None
    """Iterations to decay over; None means train_iters."""
    lr_warmup_iters: int = 0
    """Linear warmup iterations."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay iterations (overrides lr_warmup_iters)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of warmup."""


@dataclass(kw_only=True)
class GPTDatasetConfig:
    """Training data."""

    mock: bool = True
    """Deterministic synthetic token sequences from the seed (the only data source so far)."""
    sequence_length: int = 64
    """Tokens per sample."""
    random_seed: int = 1234
    """Seed of the synthetic sequences."""


@dataclass(kw_only=True)
class LoggerConfig:
    """Console, TensorBoard, W&B, MLflow and Comet logging."""

    log_interval: int = 10
    """Iterations between console iteration lines."""
    log_throughput: bool = False
    """Print and log tokens/s."""
    log_params_norm: bool = False
    """Compute and log the parameter norm."""
    tensorboard_dir: str | None = None
    """Where TensorBoard event files go (written by the last rank only)."""
    tensorboard_log_interval: int = 1
    """Iterations between TensorBoard / W&B / MLflow / Comet writes."""
    tensorboard_queue_size: int = 1000
    """Events buffered by SummaryWriter before a flush."""
    log_timers_to_tensorboard: bool = False
    """Write iteration timers to the loggers."""
    log_memory_to_tensorboard: bool = False
    """Write memory statistics (the pipeline-wide peak of each) to the loggers."""
    log_memory_per_pp_stage: bool = False
    """Also write memory/pp-stage-<i>/<name> for every pipeline stage."""
    memory_keys: dict[str, str] | None = None
    """memory_stats key -> logged name; None means train_utils.MEMORY_KEYS."""
    log_loss_scale_to_tensorboard: bool = True
    """Write the loss scale to the loggers."""
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
    comet_project: str | None = None
    """Comet project; enables Comet logging."""
    comet_experiment_name: str | None = None
    """Comet experiment name (required with comet_project)."""
    comet_workspace: str | None = None
    """Comet workspace."""
    comet_offline_directory: str | None = None
    """Write Comet experiments offline into this directory instead of uploading."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and loading."""

    save: str | None = None
    """Directory to save checkpoints into."""
    save_interval: int | None = None
    """Iterations between saves."""
    load: str | None = None
    """Directory to resume from; missing or empty starts fresh."""
    load_optim: bool = True
    """Load optimizer and scheduler state (--no-load-optim turns off)."""
    load_rng: bool = True
    """Load RNG state (--no-load-rng turns off)."""
    finetune: bool = False
    """Load weights only and reset the iteration count."""


@dataclass(kw_only=True)
class DistributedInitConfig:
    """Process launch and backend."""

    nproc_per_node: int | None = None
    """Worker processes pretrain.py starts on this machine; None means tp x pp x cp."""
    distributed_backend: str | None = None
    """nccl or gloo; None picks nccl with GPUs, gloo without."""
    distributed_timeout_minutes: int = 10
    """Timeout of collectives."""


@dataclass(kw_only=True)
class RNGConfig:
    """Random seeds."""

    seed: int = 1234
    """Seed for initialisation and data."""


def _package_present(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@dataclass(kw_only=True)
class ConfigContainer:
    """The whole run's configuration."""

    model: GPTModelProvider = field(default_factory=GPTModelProvider)
    train: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dataset: GPTDatasetConfig = field(default_factory=GPTDatasetConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)

    @property
    def model_parallel_size(self) -> int:
        m = self.model
        return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size

    @property
    def world_size(self) -> int:
        """Processes started by pretrain.py (the torchrun world when launched by torchrun)."""
        return self.dist.nproc_per_node or self.model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)

    def validate(self) -> None:
        """Raise ConfigError for the first problem found. Pure: reads config only, writes nothing."""
        for check in (
            self._check_supported,
            self._check_ranges,
            self._check_divisibility,
            self._check_logger,
        ):
            check()

    def _check_supported(self) -> None:
        m = self.model
        unsupported = {
            "--fp16": m.fp16 or self.optimizer.fp16,
            "--sequence-parallel": m.sequence_parallel,
            "--virtual-pipeline-model-parallel-size": m.virtual_pipeline_model_parallel_size not in (None, 1),
        }
        for flag, bad in unsupported.items():
            if bad:
                raise ConfigError(flag, "is not supported yet by megatron_lite's training loop")
        if not self.dataset.mock:
            raise ConfigError("--mock-data", "is required: only synthetic data is supported so far")

    def _check_ranges(self) -> None:
        m, t, o, s = self.model, self.train, self.optimizer, self.scheduler
        positive = {
            "--num-layers": m.num_layers,
            "--hidden-size": m.hidden_size,
            "--num-attention-heads": m.num_attention_heads,
            "--ffn-hidden-size": m.ffn_hidden_size,
            "--seq-length": self.dataset.sequence_length,
            "--max-position-embeddings": m.max_position_embeddings,
            "--vocab-size": m.vocab_size,
            "--micro-batch-size": t.micro_batch_size,
            "--global-batch-size": t.global_batch_size,
            "--train-iters": t.train_iters,
            "--tensor-model-parallel-size": m.tensor_model_parallel_size,
            "--pipeline-model-parallel-size": m.pipeline_model_parallel_size,
            "--context-parallel-size": m.context_parallel_size,
            "--log-interval": self.logger.log_interval,
            "--tensorboard-log-interval": self.logger.tensorboard_log_interval,
            "--tensorboard-queue-size": self.logger.tensorboard_queue_size,
            "--eval-iters": t.eval_iters,
            "--distributed-timeout-minutes": self.dist.distributed_timeout_minutes,
        }
        optional_positive = {
            "--nproc-per-node": self.dist.nproc_per_node,
            "--save-interval": self.checkpoint.save_interval,
            "--exit-interval": t.exit_interval,
            "--eval-interval": t.eval_interval,
            "--lr-decay-iters": s.lr_decay_iters,
        }
        for flag, value in {
            **positive,
            **{k: v for k, v in optional_positive.items() if v is not None},
        }.items():
            if value <= 0:
                raise ConfigError(flag, f"must be a positive integer, got {value}")
        for flag, value in {
            "--lr": o.lr,
            "--min-lr": o.min_lr,
            "--weight-decay": o.weight_decay,
            "--clip-grad": o.clip_grad,
            "--init-method-std": m.init_method_std,
            "--lr-warmup-iters": s.lr_warmup_iters,
            "--lr-warmup-init": s.lr_warmup_init,
        }.items():
            if value < 0:
                raise ConfigError(flag, f"must be >= 0, got {value}")
        for flag, value in {
            "--hidden-dropout": m.hidden_dropout,
            "--attention-dropout": m.attention_dropout,
        }.items():
            if not 0.0 <= value < 1.0:
                raise ConfigError(flag, f"must be in [0, 1), got {value}")
        if o.min_lr > o.lr:
            raise ConfigError("--min-lr", f"must not exceed --lr ({o.min_lr} > {o.lr})")
        for flag, value in {"--adam-beta1": o.adam_beta1, "--adam-beta2": o.adam_beta2}.items():
            if not 0.0 <= value < 1.0:
                raise ConfigError(flag, f"must be in [0, 1), got {value}")
        if s.lr_warmup_fraction is not None and not 0.0 <= s.lr_warmup_fraction <= 1.0:
            raise ConfigError("--lr-warmup-fraction", f"must be in [0, 1], got {s.lr_warmup_fraction}")
        if s.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ConfigError(
                "--lr-decay-style", f"must be constant, linear or cosine, got {s.lr_decay_style!r}"
            )
        if self.dataset.sequence_length > m.max_position_embeddings:
            raise ConfigError(
                "--seq-length",
                f"{self.dataset.sequence_length} exceeds --max-position-embeddings {m.max_position_embeddings}; "
                "lower --seq-length or raise --max-position-embeddings",
            )
        if self.dist.distributed_backend not in (None, "gloo", "nccl"):
            raise ConfigError("--distributed-backend", "must be gloo or nccl")
        if self.dist.distributed_backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("--distributed-backend", "nccl needs CUDA GPUs and none are visible; use gloo")

    def _check_divisibility(self) -> None:
        m, t = self.model, self.train
        tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
        if m.num_layers % pp:
            raise ConfigError(
                "--num-layers",
                f"{m.num_layers} layers do not split evenly over "
                f"--pipeline-model-parallel-size {pp}; use a multiple of {pp}",
            )
        if m.num_attention_heads % tp:
            raise ConfigError(
                "--num-attention-heads",
                f"{m.num_attention_heads} heads do not split over "
                f"--tensor-model-parallel-size {tp}; use a multiple of {tp}",
            )
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                "--hidden-size",
                f"{m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}",
            )
        if m.ffn_hidden_size % tp:
            raise ConfigError(
                "--ffn-hidden-size",
                f"{m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}",
            )
        if self.world_size % self.model_parallel_size:
            raise ConfigError(
                "--nproc-per-node",
                f"{self.world_size} processes are not divisible by tp x pp x cp = {self.model_parallel_size}",
            )
        per_step = t.micro_batch_size * self.data_parallel_size
        if t.global_batch_size % per_step:
            raise ConfigError(
                "--global-batch-size",
                f"{t.global_batch_size} is not divisible by --micro-batch-size "
                f"x data-parallel size = {t.micro_batch_size} x {self.data_parallel_size}",
            )
        cp = m.context_parallel_size
        if cp > 1 and self.dataset.sequence_length % (2 * cp):
            raise ConfigError(
                "--seq-length",
                f"must be divisible by 2 x --context-parallel-size = {2 * cp} "
                "(each CP rank holds two of 2 cp equal chunks)",
            )

    def _check_logger(self) -> None:
        lg = self.logger
        pairs = [
            ("--wandb-project", lg.wandb_project, "--wandb-exp-name", lg.wandb_exp_name, "wandb"),
            ("--mlflow-experiment", lg.mlflow_experiment, "--mlflow-run-name", lg.mlflow_run_name, "mlflow"),
            (
                "--comet-project",
                lg.comet_project,
                "--comet-experiment-name",
                lg.comet_experiment_name,
                "comet_ml",
            ),
        ]
        for flag, project, name_flag, name, package in pairs:
            if project is not None and not project.strip():
                raise ConfigError(flag, "must not be empty")
            if project and not name:
                raise ConfigError(name_flag, f"is required with {flag}; give the run a name")
            if name and not project:
                raise ConfigError(flag, f"is required with {name_flag}")
            if project and not _package_present(package):
                raise ConfigError(
                    flag,
                    f"needs the '{package}' package: pip install 'megatron_lite[{package.split('_')[0]}]'",
                )
        if lg.log_memory_per_pp_stage and not lg.log_memory_to_tensorboard:
            raise ConfigError("--log-memory-per-pp-stage", "needs --log-memory-to-tensorboard")
        if self.checkpoint.save_interval and not self.checkpoint.save:
            raise ConfigError("--save-interval", "needs --save DIR")
