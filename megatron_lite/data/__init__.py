"""Data loading (Megatron-Bridge's megatron.bridge.data)."""
