"""Transformer building blocks."""

from megatron_lite.core.transformer.transformer_config import TransformerConfig  # upstream's re-export

__all__ = ["TransformerConfig"]
