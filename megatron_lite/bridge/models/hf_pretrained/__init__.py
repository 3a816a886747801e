"""Megatron-Bridge's layout: megatron.bridge.models.hf_pretrained."""
