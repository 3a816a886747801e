"""The short vanilla GPT recipe name (upstream's ``recipes/gpt/vanilla_gpt.py``)."""

from megatron_lite.recipes.gpt.h100.vanilla_gpt import (
    vanilla_gpt_pretrain_1gpu_h100_bf16_config as vanilla_gpt_pretrain_config,
)

__all__ = ["vanilla_gpt_pretrain_config"]
