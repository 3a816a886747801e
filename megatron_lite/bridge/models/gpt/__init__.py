"""Megatron-Bridge's layout: megatron.bridge.models.gpt (the GPT model config)."""
