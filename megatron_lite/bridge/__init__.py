"""Hugging Face models in and out of megatron_lite, with Megatron-Bridge's names
(``megatron.bridge.AutoBridge``). Families: Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, GPT-2."""

from megatron_lite.bridge.models import gpt2, llama, mistral, mixtral, qwen  # noqa: F401  (registers the families)
from megatron_lite.bridge.models.conversion.auto_bridge import AutoBridge
from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.conversion.pretrained_directory import register as _register_hf_directory

_register_hf_directory()  # an HF directory as --pretrained-checkpoint loads through the bridge

__all__ = ["AutoBridge", "BridgeError"]
