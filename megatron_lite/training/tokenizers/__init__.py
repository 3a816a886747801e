"""Tokenizers (Megatron-Bridge's megatron.bridge.training.tokenizers)."""

from megatron_lite.training.tokenizers.config import TokenizerConfig
from megatron_lite.training.tokenizers.factory import get_tokenizer, tokenizer_config
from megatron_lite.training.tokenizers.tokenizer import build_tokenizer

__all__ = ["TokenizerConfig", "build_tokenizer", "get_tokenizer", "tokenizer_config"]
