"""Llama recipes for H100, named by model, task, GPU count and precision (Megatron-Bridge's)."""

from megatron_lite.recipes.llama.h100.llama3 import (
    llama3_8b_peft_1gpu_h100_bf16_config,
    llama3_8b_pretrain_2gpu_h100_bf16_config,
    llama3_8b_sft_2gpu_h100_bf16_config,
    llama3_70b_peft_8gpu_h100_bf16_config,
    llama3_70b_pretrain_32gpu_h100_bf16_config,
    llama3_70b_sft_32gpu_h100_bf16_config,
)

__all__ = [
    "llama3_70b_peft_8gpu_h100_bf16_config",
    "llama3_70b_pretrain_32gpu_h100_bf16_config",
    "llama3_70b_sft_32gpu_h100_bf16_config",
    "llama3_8b_peft_1gpu_h100_bf16_config",
    "llama3_8b_pretrain_2gpu_h100_bf16_config",
    "llama3_8b_sft_2gpu_h100_bf16_config",
]
