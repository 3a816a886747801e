"""The run's configuration: typed sections (Megatron-Bridge's ``megatron.bridge.training.config``),
one flag table (``flags``, with each numeric flag's range in ``ranges``) and every check (``validate``).

``container``: ConfigContainer, which holds the sections and validates them; ``training``: the
training loop, validation and learning-rate schedule; ``optimizer``: the optimizer and DDP; ``data``:
datasets and loaders; ``mixed_precision``: precision recipes; ``logging``, ``checkpoint``,
``profiling``, ``runtime`` (launch, seeds, rerun); ``base``: the dict/YAML
round trip every section shares.
"""

from megatron_lite.data.base import DataloaderConfig, DatasetBuildContext, DatasetProvider
from megatron_lite.training.config.checkpoint import CheckpointConfig
from megatron_lite.training.config.container import (
    ConfigContainer,
    apply_environment_variables,
    runtime_config_update,
)
from megatron_lite.training.config.data import GPTDatasetConfig, MockGPTDatasetConfig
from megatron_lite.training.config.logging import LoggerConfig
from megatron_lite.training.config.mixed_precision import MixedPrecisionConfig, get_mixed_precision_config

# Upstream's tests import these private checks from megatron.bridge.training.config itself.
from megatron_lite.training.config.optimizer import (  # noqa: F401
    DistributedDataParallelConfig,
    OptimizerConfig,
    _validate_and_sync_distributed_optimizer_settings,
    _validate_mixed_precision_consistency,
)
from megatron_lite.training.config.profiling import ProfilingConfig
from megatron_lite.training.config.runtime import DistributedInitConfig, RerunStateMachineConfig, RNGConfig
from megatron_lite.training.config.training import SchedulerConfig, TrainingConfig, ValidationConfig
from megatron_lite.training.errors import ConfigError, MissingPackageError
from megatron_lite.training.tokenizers.config import TokenizerConfig
from megatron_lite.utils.common_utils import get_world_size_safe, warn_rank_0

__all__ = [
    "CheckpointConfig",
    "ConfigContainer",
    "ConfigError",
    "DataloaderConfig",
    "DatasetBuildContext",
    "DatasetProvider",
    "DistributedDataParallelConfig",
    "DistributedInitConfig",
    "GPTDatasetConfig",
    "LoggerConfig",
    "MissingPackageError",
    "MixedPrecisionConfig",
    "MockGPTDatasetConfig",
    "OptimizerConfig",
    "ProfilingConfig",
    "RNGConfig",
    "RerunStateMachineConfig",
    "SchedulerConfig",
    "TokenizerConfig",
    "TrainingConfig",
    "ValidationConfig",
    "apply_environment_variables",
    "get_mixed_precision_config",
    "get_world_size_safe",
    "runtime_config_update",
    "warn_rank_0",
]
