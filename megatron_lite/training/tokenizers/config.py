"""TokenizerConfig: which tokenizer turns text into ids.

The mock data is already token ids (``model.vocab_size`` of them), so megatron_lite needs no
tokenizer yet; real tokenizers are a later feature and ConfigContainer.validate refuses one set.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TokenizerConfig:
    """Tokenizer selection, with upstream's field names."""

    tokenizer_type: str | None = None
    """Tokenizer class, e.g. GPT2BPETokenizer (not supported yet: None or NullTokenizer)."""
    tokenizer_model: str | None = None
    """Tokenizer model file or HuggingFace id (not supported yet: None)."""
    vocab_size: int | None = None
    """Vocabulary size of a NullTokenizer; None means model.vocab_size."""
    vocab_file: str | None = None
    """Vocabulary file (not supported yet: None)."""
    merge_file: str | None = None
    """BPE merge file (not supported yet: None)."""
    metadata_path: str | None = None
    """Tokenizer metadata file (not supported yet: None)."""
