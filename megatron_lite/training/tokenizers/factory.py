"""The run's tokenizer, from its config section: built from local files once per process, and a
corrupt tokenizer file is one ConfigError naming its flag (upstream: ``build_tokenizer`` in
megatron.bridge.training.tokenizers, called from the data set-up)."""

from __future__ import annotations

import dataclasses
import functools

from megatron_lite.training.errors import ConfigError
from megatron_lite.training.tokenizers.config import TokenizerConfig
from megatron_lite.training.tokenizers.tokenizer import build_tokenizer

_TOKENIZER_FILE_FLAG = {"GPT2BPETokenizer": "--vocab-file", "HuggingFaceTokenizer": "--tokenizer-model"}


def tokenizer_config(cfg) -> TokenizerConfig | None:
    """``cfg.tokenizer`` with a NullTokenizer's size filled in (model.vocab_size - 1, so that with
    its end-of-document id it is the model's); None without a tokenizer."""
    tok = cfg.tokenizer
    if tok.tokenizer_type is None:
        return None
    if tok.tokenizer_type == "NullTokenizer" and tok.vocab_size is None:
        return dataclasses.replace(tok, vocab_size=cfg.model.vocab_size - 1)
    return tok


def get_tokenizer(cfg):
    """The run's tokenizer, built from local files once per process; None without one."""
    tok = tokenizer_config(cfg)
    if tok is None:
        return None
    key = (tok.tokenizer_type, tok.tokenizer_model, tok.vocab_file, tok.merge_file, tok.vocab_size)
    return _build(key)


@functools.lru_cache(maxsize=4)
def _build(key):
    kind, model, vocab_file, merge_file, vocab_size = key
    config = TokenizerConfig(
        tokenizer_type=kind,
        tokenizer_model=model,
        vocab_file=vocab_file,
        merge_file=merge_file,
        vocab_size=vocab_size,
    )
    try:
        return build_tokenizer(config)
    except ConfigError:
        raise
    except Exception as err:  # a corrupt vocab.json / tokenizer.json: say which file, in one line
        flag = _TOKENIZER_FILE_FLAG.get(kind, "--tokenizer-type")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(flag, f"{kind} cannot be built from its files: {first}") from None
