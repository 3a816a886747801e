"""Qwen recipes for H100, named by model, task, GPU count and precision (Megatron-Bridge's)."""

from megatron_lite.recipes.qwen.h100.qwen2 import qwen2_7b_pretrain_2gpu_h100_bf16_config

__all__ = ["qwen2_7b_pretrain_2gpu_h100_bf16_config"]
