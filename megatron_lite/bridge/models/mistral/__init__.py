"""Mistral."""

from megatron_lite.bridge.models.mistral.mistral_bridge import MistralBridge

__all__ = ["MistralBridge"]
