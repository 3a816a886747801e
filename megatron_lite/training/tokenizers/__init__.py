"""Tokenizer configuration (Megatron-Bridge's megatron.bridge.training.tokenizers)."""
