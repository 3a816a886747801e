"""Parameter-efficient fine-tuning with Megatron-Bridge's names and semantics (``megatron.bridge.peft``):
``LoRA`` freezes the base model and wraps each matched linear layer in a ``LoRALinear`` whose
``ParallelLinearAdapter`` is split like the layer; ``LoRAMerge`` / ``lora_merge.merge_lora_model``
fold the adapters back into the weights. Depends on megatron_lite.core only."""

from megatron_lite.peft.adapter_wrapper import AdapterWrapper
from megatron_lite.peft.base import PEFT
from megatron_lite.peft.expert_adapters import GroupedExpertLinearAdapter
from megatron_lite.peft.lora import LoRA
from megatron_lite.peft.lora_layers import LoRALinear
from megatron_lite.peft.lora_merge import LoRAMerge, merge_lora_model
from megatron_lite.peft.module_matcher import ModuleMatcher
from megatron_lite.peft.parallel_adapter import ParallelLinearAdapter
from megatron_lite.peft.utils import is_adapter_key, wildcard_match

__all__ = [
    "PEFT",
    "AdapterWrapper",
    "GroupedExpertLinearAdapter",
    "LoRA",
    "LoRALinear",
    "LoRAMerge",
    "ModuleMatcher",
    "ParallelLinearAdapter",
    "is_adapter_key",
    "merge_lora_model",
    "wildcard_match",
]
