"""Tokenizer defaults of the recipes (Megatron-Bridge's ``recipes.utils.tokenizer_utils``)."""

DEFAULT_NULL_TOKENIZER_VOCAB_SIZE: int = 32000
"""The NullTokenizer's vocabulary in every pretraining recipe on mock data, as upstream."""
