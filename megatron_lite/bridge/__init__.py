"""Hugging Face models in and out of megatron_lite, with Megatron-Bridge's names
(``megatron.bridge.AutoBridge``). Families: Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, GPT-2."""

from megatron_lite.bridge.models import gpt2, llama, mistral, mixtral, qwen  # noqa: F401  (registers the families)
from megatron_lite.bridge.models.conversion.auto_bridge import AutoBridge
from megatron_lite.bridge.models.conversion.errors import BridgeError

__all__ = ["AutoBridge", "BridgeError"]
