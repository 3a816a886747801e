"""TokenizerConfig: which tokenizer turns text into ids (Megatron-Bridge's field names).

``build_tokenizer`` (tokenizers/tokenizer.py) builds it. Mock data is already ids and needs none;
real data needs one for its end-of-document id, and the model's vocabulary follows it
(training/config/validate/data.py: resolve_vocab_size).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TokenizerConfig:
    """Tokenizer selection, with upstream's field names."""

    tokenizer_type: str | None = None
    """NullTokenizer, GPT2BPETokenizer or HuggingFaceTokenizer; None: no tokenizer (mock data)."""
    tokenizer_model: str | None = None
    """HuggingFaceTokenizer: a local directory holding tokenizer.json, or that file (never downloaded)."""
    vocab_size: int | None = None
    """NullTokenizer's vocabulary without its end-of-document id; None means model.vocab_size - 1."""
    vocab_file: str | None = None
    """GPT2BPETokenizer: GPT-2's vocab.json."""
    merge_file: str | None = None
    """GPT2BPETokenizer: GPT-2's merges.txt."""
    metadata_path: str | None = None
    """Tokenizer metadata file (not supported yet: None)."""
    use_tokenizer_vocab_size: bool = False
    """The model's vocabulary is the tokenizer's, whatever model.vocab_size says (pretrain.py sets it,
    as Megatron-LM); else the model's is kept when it holds every token id (Megatron-Bridge)."""
