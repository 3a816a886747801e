"""The run's configuration: typed sections (Megatron-Bridge's ``megatron.bridge.training.config``),
one flag table (``flags``, with each numeric flag's range in ``ranges``) and every check (``validate``).

``container``: ConfigContainer, which holds the sections and validates them; ``training``: the
training loop, validation and learning-rate schedule; ``optimizer``: the optimizer and DDP; ``data``:
datasets and loaders; ``logging``, ``checkpoint``, ``profiling``, ``runtime`` (launch, seeds, rerun);
``errors``: ConfigError; ``base``: the dict/YAML round trip every section shares.
"""

from megatron_lite.training.config.checkpoint import CheckpointConfig
from megatron_lite.training.config.container import (
    ConfigContainer,
    apply_environment_variables,
    runtime_config_update,
)
from megatron_lite.training.config.data import DataloaderConfig, GPTDatasetConfig, MockGPTDatasetConfig
from megatron_lite.training.config.errors import ConfigError, MissingPackageError
from megatron_lite.training.config.logging import LoggerConfig

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
from megatron_lite.training.tokenizers.config import TokenizerConfig
from megatron_lite.utils.common_utils import get_world_size_safe

__all__ = [
    "CheckpointConfig",
    "ConfigContainer",
    "ConfigError",
    "DataloaderConfig",
    "DistributedDataParallelConfig",
    "DistributedInitConfig",
    "GPTDatasetConfig",
    "LoggerConfig",
    "MissingPackageError",
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
    "get_world_size_safe",
    "runtime_config_update",
]
