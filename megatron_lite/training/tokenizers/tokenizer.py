"""build_tokenizer(TokenizerConfig): Megatron's tokenizers, on local files only.

``NullTokenizer`` (ids written as space-separated integers; ``eod`` = vocab_size, as upstream),
``GPT2BPETokenizer`` (a GPT-2 ``vocab.json`` + ``merges.txt``: byte-level BPE, ``<|endoftext|>`` is
``eod``) and ``HuggingFaceTokenizer`` (``tokenizer_model`` = a local directory holding
``tokenizer.json``, or that file). The BPE work is done in Rust by the ``tokenizers`` package, and
GPT-2 encoding by tiktoken where its result is provably the same (gpt2_bpe.py), which is what makes
tools/preprocess_data.py fast; nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

from megatron_lite.training.errors import ConfigError
from megatron_lite.training.tokenizers.config import TokenizerConfig
from megatron_lite.training.tokenizers.gpt2_bpe import tiktoken_encoding

SUPPORTED_TOKENIZERS = ("NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class MegatronTokenizer:
    """Upstream's tokenizer surface: ``tokenize`` / ``detokenize``, ``vocab_size``, ``eod``."""

    def __init__(self, **identifiers) -> None:
        self.unique_identifiers = OrderedDict(
            {"class": type(self).__name__, **{k: str(v) for k, v in identifiers.items()}}
        )

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: list[int]) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod(self) -> int:
        raise NotImplementedError

    @property
    def eos(self) -> int:
        return self.eod


class NullTokenizer(MegatronTokenizer):
    """Text is already ids ("5 17 3"); one extra id, the last, is the end-of-document token."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size)
        self._vocab_size_without_eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(x)) for x in ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod


class _RustTokenizer(MegatronTokenizer):
    """A ``tokenizers.Tokenizer`` behind upstream's surface."""

    def __init__(self, tokenizer, eod_token: str | None, **identifiers) -> None:
        super().__init__(**identifiers)
        self._tokenizer = tokenizer
        self._eod = tokenizer.token_to_id(eod_token) if eod_token is not None else None

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts in one call into Rust (one thread: preprocess_data parallelises by process)."""
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)  # no offsets
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise ValueError(f"{type(self).__name__} has no end-of-document token")
        return self._eod


class GPT2BPETokenizer(_RustTokenizer):
    """GPT-2's byte-level BPE from its ``vocab.json`` and ``merges.txt``."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        # GPT-2 splits with its regex and maps bytes to printable characters; no space is prepended.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        super().__init__(tok, "<|endoftext|>", vocab_file=vocab_file, merge_file=merge_file)
        if self._eod is None:
            raise ValueError(f"{vocab_file} has no <|endoftext|> token")
        self._fast = tiktoken_encoding(vocab_file, merge_file, {"<|endoftext|>": self._eod})

    def tokenize(self, text: str) -> list[int]:
        # Special-token text is encoded as plain text, as upstream's GPT-2 tokenizer does.
        return self._fast.encode_ordinary(text) if self._fast is not None else super().tokenize(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is None:
            return super().tokenize_batch(texts)
        return [self._fast.encode_ordinary(t) for t in texts]


class HuggingFaceTokenizer(_RustTokenizer):
    """A local Hugging Face fast tokenizer (``tokenizer.json``); eod is its eos token."""

    def __init__(self, tokenizer_model: str) -> None:
        from tokenizers import Tokenizer

        path = (
            os.path.join(tokenizer_model, "tokenizer.json")
            if os.path.isdir(tokenizer_model)
            else tokenizer_model
        )
        tok = Tokenizer.from_file(path)
        vocab = tok.get_vocab(with_added_tokens=True)
        eod = _eos_from_config(os.path.dirname(path))
        eod = eod if eod in vocab else next((t for t in _EOD_CANDIDATES if t in vocab), None)
        super().__init__(tok, eod, tokenizer_model=tokenizer_model)


def _eos_from_config(directory: str) -> str | None:
    """The eos token named by a tokenizer_config.json next to tokenizer.json, if any."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        eos = json.load(f).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def _require_file(flag: str, path: str | None, what: str) -> None:
    if path is None:
        raise ConfigError(flag, f"is required by this tokenizer ({what})")
    if not os.path.exists(path):
        raise ConfigError(flag, f"{path} does not exist ({what})")


def build_tokenizer(config: TokenizerConfig, **kwargs) -> MegatronTokenizer:
    """The tokenizer ``config`` names; a ConfigError naming the flag when a file is missing."""
    kind = config.tokenizer_type
    if kind == "NullTokenizer":
        if config.vocab_size is None:
            raise ConfigError("--vocab-size", "is required by NullTokenizer")
        return NullTokenizer(config.vocab_size)
    if kind == "GPT2BPETokenizer":
        _require_file("--vocab-file", config.vocab_file, "GPT-2 vocab.json")
        _require_file("--merge-file", config.merge_file, "GPT-2 merges.txt")
        return GPT2BPETokenizer(config.vocab_file, config.merge_file)
    if kind == "HuggingFaceTokenizer":
        _require_file(
            "--tokenizer-model", config.tokenizer_model, "a local tokenizer directory or tokenizer.json"
        )
        return HuggingFaceTokenizer(config.tokenizer_model)
    raise ConfigError(
        "--tokenizer-type",
        f"{kind!r} is not supported yet by megatron_lite (choose from {SUPPORTED_TOKENIZERS})",
    )
