"""The short Qwen2 recipe names, aliases of the hardware-named ones (upstream's ``recipes/qwen/qwen2.py``)."""

from megatron_lite.recipes.qwen.h100.qwen2 import (
    qwen2_7b_pretrain_2gpu_h100_bf16_config as qwen2_7b_pretrain_config,
)

__all__ = ["qwen2_7b_pretrain_config"]
