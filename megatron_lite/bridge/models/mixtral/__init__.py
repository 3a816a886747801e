"""Mixtral."""

from megatron_lite.bridge.models.mixtral.mixtral_bridge import MixtralBridge

__all__ = ["MixtralBridge"]
