"""Qwen2 and Qwen2-MoE."""

from megatron_lite.bridge.models.qwen.qwen2_bridge import Qwen2Bridge
from megatron_lite.bridge.models.qwen.qwen2_moe_bridge import Qwen2MoeBridge

__all__ = ["Qwen2Bridge", "Qwen2MoeBridge"]
