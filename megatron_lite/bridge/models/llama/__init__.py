"""Llama."""

from megatron_lite.bridge.models.llama.llama_bridge import LlamaBridge

__all__ = ["LlamaBridge"]
