"""ConfigContainer: the whole run's configuration as typed sections, validated in one place.

Sections and names mirror Megatron-Bridge's ``megatron.bridge.training.config`` (``train``,
``model``, ``optimizer``, ``scheduler``, ``dataset``, ``logger``, ``tokenizer``, ``checkpoint``,
``dist``, ``ddp``, ``rng``, ``validation``, ...). :meth:`ConfigContainer.validate` finalizes every
section, derives the data-parallel size and the scheduler's steps, runs upstream's checks and then
megatron_lite's (``validate/``: general, data, layout, architecture, activation levers). It runs on every rank before
any collective, and in the launcher before any worker starts; every failure is a
:class:`ConfigError`, which is also the ``AssertionError`` / ``ValueError`` upstream's checks raise.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from dataclasses import dataclass, field, fields

from megatron_lite.data.base import DatasetProvider
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.peft import PEFT
from megatron_lite.training.cli.ranges import check_config_ranges
from megatron_lite.training.config.base import _ConfigContainerBase
from megatron_lite.training.config.checkpoint import CheckpointConfig
from megatron_lite.training.config.data import GPTDatasetConfig, MockGPTDatasetConfig
from megatron_lite.training.config.logging import LoggerConfig
from megatron_lite.training.config.mixed_precision import MixedPrecisionConfig, get_mixed_precision_config
from megatron_lite.training.config.optimizer import (
    DistributedDataParallelConfig,
    OptimizerConfig,
    _validate_and_sync_distributed_optimizer_settings,
    _validate_mixed_precision_consistency,
)
from megatron_lite.training.config.profiling import ProfilingConfig
from megatron_lite.training.config.runtime import DistributedInitConfig, RerunStateMachineConfig, RNGConfig
from megatron_lite.training.config.training import (
    SchedulerConfig,
    TrainingConfig,
    ValidationConfig,
    check_schedule_mode,
    derive_scheduler_steps,
)
from megatron_lite.training.config.validate import run_checks
from megatron_lite.training.config.validate.data import resolve_vocab_size
from megatron_lite.training.errors import ConfigError, ConfigTypeError, require
from megatron_lite.training.tokenizers.config import TokenizerConfig

__all__ = ["ConfigContainer", "apply_environment_variables", "runtime_config_update"]


# ConfigContainer() is megatron_lite's demo run (about a minute on two CPU cores); each section's
# own defaults are upstream's.
def _demo_train() -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, global_batch_size=16, train_iters=100)


def _demo_dataset() -> GPTDatasetConfig:
    return MockGPTDatasetConfig(
        seq_length=64,
        random_seed=1234,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )


@dataclass(kw_only=True)
class ConfigContainer(_ConfigContainerBase):
    """The whole run's configuration. Optional features megatron_lite lacks are None-only fields."""

    env_vars: dict[str, str | int | float | bool] = field(default_factory=dict)
    """Environment defaults applied by runtime_config_update (values already set win)."""
    rng: RNGConfig = field(default_factory=RNGConfig)
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    train: TrainingConfig = field(default_factory=_demo_train)
    model: GPTModelProvider = field(default_factory=lambda: GPTModelProvider(max_position_embeddings=64))
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(min_lr=3e-4))
    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    validation: ValidationConfig = field(default_factory=lambda: ValidationConfig(eval_iters=10))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dataset: GPTDatasetConfig | DatasetProvider = field(default_factory=_demo_dataset)
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(log_interval=10))
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    profiling: ProfilingConfig | None = None
    """Profiler settings; None profiles nothing."""
    mixed_precision: MixedPrecisionConfig | str | None = None
    """Mixed-precision recipe (a MixedPrecisionConfig or a recipe's name, e.g. ``"bf16_mixed"``),
    applied to the model, optimizer and DDP sections by :func:`runtime_config_update`."""
    comm_overlap: object | None = None
    """Communication-overlap tuning (not supported: None)."""
    peft: PEFT | None = None
    """Parameter-efficient fine-tuning (Megatron-Bridge's: a ``megatron_lite.peft.LoRA``): the base
    weights from ``checkpoint.pretrained_checkpoint``, frozen; only the adapters train and are saved.
    None trains every parameter."""
    ft: object | None = None
    """Fault tolerance (not supported: None)."""
    straggler: object | None = None
    """Straggler detection (not supported: None)."""
    nvrx_straggler: object | None = None
    """NVRx straggler detection (not supported: None)."""
    tensor_inspect: object | None = None
    """Tensor inspection (not supported: None)."""
    inprocess_restart: object | None = None
    """In-process restart (not supported: None)."""
    _data_parallel_size: int | None = field(default=None, init=False, repr=False, compare=False)
    _validated: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def model_parallel_size(self) -> int:
        m = self.model
        return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size

    @property
    def world_size(self) -> int:
        """Processes of the run: --nproc-per-node when given (pretrain.py's own launcher), else the
        world torch.distributed or torchrun's WORLD_SIZE reports."""
        # Looked up on the package at call time: upstream's tests patch
        # megatron.bridge.training.config.get_world_size_safe, the package's name for it.
        return self.dist.nproc_per_node or sys.modules[__package__].get_world_size_safe()

    @property
    def data_parallel_size(self) -> int:
        """Set by set_data_parallel_size (validate and runtime_config_update call it); as upstream,
        the attribute does not exist before that."""
        if self._data_parallel_size is None:
            raise AttributeError(
                "data_parallel_size is set by set_data_parallel_size() (validate() calls it)"
            )
        return self._data_parallel_size

    @data_parallel_size.setter
    def data_parallel_size(self, value: int) -> None:
        self._data_parallel_size = value

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)

    def get_data_parallel_size(self, world_size: int) -> int:
        """world_size / (tp x pp x cp); a ConfigError when it does not divide."""
        mp = self.model_parallel_size
        require(
            world_size % mp == 0,
            "--nproc-per-node",
            f"world size ({world_size}) is not divisible by total_model_size (tp x pp x cp = {mp})",
        )
        return world_size // mp

    def set_data_parallel_size(self) -> None:
        self.data_parallel_size = self.get_data_parallel_size(self.world_size)

    def validate(self) -> None:
        """Finalize every section, derive values, and raise ConfigError for the first problem."""
        check_config_ranges(self, early=True)  # before anything divides by a size or derives from a rate
        check_environment_variables(self.env_vars)
        for section in (self.dataset, self.ddp, self.optimizer, self.model):
            if hasattr(section, "finalize"):
                section.finalize()
        self.logger.finalize()
        self.train.finalize()
        self.scheduler.finalize()
        self.checkpoint.finalize()
        if self.profiling is not None:
            self.profiling.finalize()
        self.set_data_parallel_size()
        resolve_vocab_size(self)  # builds the tokenizer (local files only): the vocabulary follows it
        self._resolve_validation_batches()
        _validate_and_sync_distributed_optimizer_settings(self)
        _validate_mixed_precision_consistency(self)
        self.model.use_cpu_initialization = self.model.use_cpu_initialization or self.dist.lazy_mpu_init
        if getattr(self.model, "num_query_groups", None) is None and hasattr(self.model, "num_query_groups"):
            self.model.num_query_groups = self.model.num_attention_heads  # as MCore: one group per head
        self._validate_training_scheduler_compatibility()
        if self.train.train_iters is not None:
            self._calculate_scheduler_steps()
        cp = self.model.context_parallel_size
        require(
            cp == 1 or self.model.seq_length % (2 * cp) == 0,
            "--seq-length",
            "Sequence length must be divisible by 2 * context parallel size if context parallel is used "
            f"({self.model.seq_length} % {2 * cp}; each CP rank holds two of 2 cp equal chunks)",
        )
        # A custom DatasetProvider may have no seq_length of its own (as upstream).
        require(
            getattr(self.dataset, "seq_length", self.model.seq_length) == self.model.seq_length,
            "--seq-length",
            "Please ensure sequence length configuration in model config and dataset config match "
            f"(model {self.model.seq_length}, dataset {getattr(self.dataset, 'seq_length', None)})",
        )
        for f in fields(ValidationConfig):
            value = getattr(self.train, f.name, None)
            if value is not None:
                warnings.warn(
                    f"TrainingConfig.{f.name} is deprecated; use ValidationConfig.{f.name}", stacklevel=2
                )
                setattr(self.validation, f.name, value)
        run_checks(self)
        self._validated = True

    def _resolve_validation_batches(self) -> None:
        v, t = self.validation, self.train
        if v.eval_global_batch_size is None:
            require(
                t.global_batch_size is not None,
                "--global-batch-size",
                "train.global_batch_size must be set when eval_global_batch_size is not explicitly configured",
            )
            v.eval_global_batch_size = t.global_batch_size
        if v.eval_micro_batch_size is None:
            require(
                t.micro_batch_size is not None,
                "--micro-batch-size",
                "train.micro_batch_size must be set when eval_micro_batch_size is not explicitly configured",
            )
            v.eval_micro_batch_size = t.micro_batch_size
        dp = self.data_parallel_size
        per_step = v.eval_micro_batch_size * dp
        if v.eval_global_batch_size % per_step == 0:
            return
        if (v.eval_global_batch_size, v.eval_micro_batch_size) == (t.global_batch_size, t.micro_batch_size):
            # Defaults taken from training: name the training flags the user actually gave.
            raise ConfigError(
                "--global-batch-size",
                f"{t.global_batch_size} is not divisible by --micro-batch-size x data-parallel size = "
                f"{t.micro_batch_size} x {dp} (the eval_global_batch_size defaults to it, and it must be "
                "divisible by the same)",
            )
        raise ConfigError(
            "validation.eval_global_batch_size",
            f"eval_global_batch_size ({v.eval_global_batch_size}) must be divisible by eval_micro_batch_size "
            f"* eval_data_parallel_size ({v.eval_micro_batch_size} * {dp} = {per_step})",
        )

    def _validate_training_scheduler_compatibility(self) -> None:
        check_schedule_mode(self.train, self.scheduler)

    def _calculate_scheduler_steps(self) -> None:
        derive_scheduler_steps(self.train, self.scheduler)


# Variables through which a process loads code it was not given: the dynamic loader's, Python's, a
# CUDA injection library, NCCL's plugins. A config file is data and must not name them (nothing read
# from disk may execute code); set them in the launcher's environment where that is meant.
_CODE_LOADING_ENV = re.compile(r"^(LD_|DYLD_|PYTHON|CUDA_INJECTION|BASH_ENV$|ENV$|PATH$)|_PLUGIN(_|$)")


def check_environment_variables(env_vars: dict) -> None:
    """``env_vars`` as a config may hold them: non-empty names, scalar values (ConfigTypeError, a
    TypeError as upstream's), and no variable through which a process loads code."""
    for name, value in env_vars.items():
        if not isinstance(name, str) or not name:
            raise ConfigError("env_vars", "Environment variable names must be non-empty strings.")
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigTypeError(
                f"env_vars.{name}",
                f"must have a scalar value (str, int, float, bool), got {type(value).__name__}",
            )
        if _CODE_LOADING_ENV.search(name):
            raise ConfigError(
                f"env_vars.{name}",
                "makes a process load code (the loader's, Python's, CUDA's or NCCL's plugin variables); "
                "a config may not set it: set it in the launcher's environment",
            )


def apply_environment_variables(cfg: ConfigContainer) -> None:
    """Set ``cfg.env_vars`` in this process's environment, keeping values already set there; all are
    checked first, so a bad one sets none."""
    check_environment_variables(cfg.env_vars)
    for name, value in cfg.env_vars.items():
        os.environ.setdefault(name, str(value))


def runtime_config_update(cfg: ConfigContainer) -> None:
    """As upstream, before initialization: apply environment defaults, resolve and apply the
    mixed-precision recipe, derive the data-parallel size, then validate (megatron_lite has no
    communication-overlap setup to apply)."""
    apply_environment_variables(cfg)
    if cfg.mixed_precision is not None:
        cfg.mixed_precision = get_mixed_precision_config(cfg.mixed_precision)
        cfg.mixed_precision.finalize()
        cfg.mixed_precision.setup(cfg.model, cfg.optimizer, cfg.ddp)
    cfg.set_data_parallel_size()
    cfg.validate()
