"""Megatron-Bridge's layout: megatron.bridge.models.conversion."""
