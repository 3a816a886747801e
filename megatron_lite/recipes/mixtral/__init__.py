"""Mixtral recipes (upstream had no hardware-named Mixtral recipe: ``mixtral.py`` holds the one it had)."""

from megatron_lite.recipes.mixtral.mixtral import mixtral_8x7b_pretrain_config

__all__ = ["mixtral_8x7b_pretrain_config"]
