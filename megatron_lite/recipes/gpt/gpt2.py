"""The short GPT-2 recipe name, an alias of the device-named one (as upstream's short names are)."""

from megatron_lite.recipes.gpt.cpu.gpt2 import (
    gpt2_124m_pretrain_1cpu_fp32_config as gpt2_small_pretrain_cpu_config,
)

__all__ = ["gpt2_small_pretrain_cpu_config"]
