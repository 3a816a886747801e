"""Upstream's path (megatron.bridge.training.utils.config_utils) to the base every config section
shares; it lives in ``megatron_lite.training.config.base``."""

from megatron_lite.training.config.base import _ConfigContainerBase

__all__ = ["_ConfigContainerBase"]
