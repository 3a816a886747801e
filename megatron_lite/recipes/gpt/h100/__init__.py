"""GPT recipes for H100 (Megatron-Bridge's names)."""

from megatron_lite.recipes.gpt.h100.vanilla_gpt import vanilla_gpt_pretrain_1gpu_h100_bf16_config

__all__ = ["vanilla_gpt_pretrain_1gpu_h100_bf16_config"]
