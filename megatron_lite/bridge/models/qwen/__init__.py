"""Qwen2."""

from megatron_lite.bridge.models.qwen.qwen2_bridge import Qwen2Bridge

__all__ = ["Qwen2Bridge"]
