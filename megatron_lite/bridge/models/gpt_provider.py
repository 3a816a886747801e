"""Megatron-Bridge's path (``megatron.bridge.models.gpt_provider``) to megatron_lite's GPTModelProvider."""

from megatron_lite.models.gpt_provider import GPTModelProvider, default_layer_spec, local_layer_spec

__all__ = ["GPTModelProvider", "default_layer_spec", "local_layer_spec"]
