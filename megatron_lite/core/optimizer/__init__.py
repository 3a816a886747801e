"""Optimizer, gradient clipping and learning-rate schedule."""

from megatron_lite.core.optimizer.optimizer import MegatronOptimizer
from megatron_lite.core.optimizer.optimizer_config import OptimizerConfig
from megatron_lite.core.optimizer.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = ["MegatronOptimizer", "OptimizerConfig", "OptimizerParamScheduler"]
