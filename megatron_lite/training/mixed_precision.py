"""Upstream's path (``megatron.bridge.training.mixed_precision``) to the precision recipes, which
live in ``megatron_lite.training.config.mixed_precision``."""

from megatron_lite.training.config.mixed_precision import (
    MIXED_PRECISION_RECIPES,
    MixedPrecisionConfig,
    bf16_mixed,
    fp16_mixed,
    get_mixed_precision_config,
    register,
)

__all__ = [
    "MIXED_PRECISION_RECIPES",
    "MixedPrecisionConfig",
    "bf16_mixed",
    "fp16_mixed",
    "get_mixed_precision_config",
    "register",
]
