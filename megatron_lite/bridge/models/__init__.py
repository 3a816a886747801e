"""Megatron-Bridge's layout: megatron.bridge.models, with ``AutoBridge`` at its upstream path."""

from megatron_lite.bridge.models import gpt2, llama, mistral, mixtral, qwen  # noqa: F401  (registers the families)
from megatron_lite.bridge.models.conversion.auto_bridge import AutoBridge

__all__ = ["AutoBridge"]
