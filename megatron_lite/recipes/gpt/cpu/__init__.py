"""Recipes for a laptop's CPU (megatron_lite's own: upstream has none)."""

from megatron_lite.recipes.gpt.cpu.gpt2 import gpt2_124m_pretrain_1cpu_fp32_config

__all__ = ["gpt2_124m_pretrain_1cpu_fp32_config"]
