"""From the files ``--data-path`` names to each split's examples and rows.

A JSONL file is read (examples), rendered and tokenized (prompt) and fitted to the row (truncation);
a pack file (tools/prepare_sft_data.py) is loaded as it is, after checking it was made for this row
length, alignment and tokenizer. Each process does this once per file: the launcher's validation and
a worker's validation and dataset build share the result (the cache below), so bad input is found
before any worker starts and costs one pass per process.
"""

from __future__ import annotations

import os

from megatron_lite.data.sft.dataset import ExampleStats, TokenizedExamples, fit_examples
from megatron_lite.data.sft.examples import read_examples
from megatron_lite.data.sft.packed_file import load_packs, tokenizer_identity
from megatron_lite.data.sft.packing import pack_examples
from megatron_lite.data.sft.prompt import PromptRenderer
from megatron_lite.training.errors import ConfigError

_CACHE: dict[tuple, tuple] = {}


def load_jsonl(path: str, tokenizer, seq_length: int, truncation: str, pad_seq_to_mult: int, chat: bool):
    """``(TokenizedExamples, ExampleStats, renderer)`` of the JSONL ``path``; ConfigError naming the
    file and line for bad input."""
    try:
        stat = os.stat(path)
    except OSError as err:
        raise ConfigError("--data-path", f"{path}: cannot be read ({err.strerror})") from None
    key = (
        "jsonl",
        path,
        stat.st_mtime_ns,
        stat.st_size,
        id(tokenizer),
        seq_length,
        truncation,
        pad_seq_to_mult,
        chat,
    )
    if key not in _CACHE:
        renderer = PromptRenderer(tokenizer, use_chat_template=chat)
        tokenized = (renderer.tokenize(e) for e in read_examples(path))
        examples, stats = fit_examples(tokenized, seq_length, truncation, pad_seq_to_mult)
        if not len(examples):
            raise ConfigError("--data-path", f"{path}: no example has an answer token left to learn")
        if len(_CACHE) >= 8:  # a run names a few files; keep at most eight
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (examples, stats, renderer, tokenizer)
    return _CACHE[key][:3]


def load_pack_file(path: str, tokenizer, seq_length: int, pad_seq_to_mult: int):
    """``(TokenizedExamples, packs)`` of a pack file made for this run's rows and tokenizer."""
    examples, packs, meta = load_packs(path)
    made = {"seq_length": str(seq_length), "pad_seq_to_mult": str(pad_seq_to_mult)}
    for name, want in made.items():
        if meta.get(name) != want:
            raise ConfigError(
                "--data-path",
                f"{path}: packed with {name} {meta.get(name)}, this run needs {want}; pack again with "
                "tools/prepare_sft_data.py",
            )
    if meta.get("tokenizer") != tokenizer_identity(tokenizer):
        raise ConfigError("--data-path", f"{path}: packed with another tokenizer ({meta.get('tokenizer')})")
    return examples, packs


def concatenate(parts: list[TokenizedExamples]) -> TokenizedExamples:
    return TokenizedExamples.from_list([parts_i[j] for parts_i in parts for j in range(len(parts_i))])


def restrict(examples: TokenizedExamples, rows: list[list[int]]):
    """Only the examples ``rows`` use, and the rows renumbered onto them (a split of a pack file)."""
    used = sorted({i for row in rows for i in row})
    new = {old: j for j, old in enumerate(used)}
    return examples.subset(used), [[new[i] for i in row] for row in rows]


def split_ranges(n: int, split_matrix) -> list[range | None]:
    """Each split's contiguous range of ``n`` items (upstream's document split)."""
    return [None if b is None else range(round(b[0] * n), round(b[1] * n)) for b in split_matrix]


def summary_line(path: str, stats: ExampleStats, seq_length: int, renderer) -> str:
    """The one line per file that says what was done to its examples."""
    prompt = "the tokenizer's chat template" if renderer.uses_chat_template else "the default prompt format"
    return (
        f"> SFT {path}: {stats.examples} examples rendered with {prompt}; {stats.truncated} longer than "
        f"{seq_length} tokens truncated on the right, {stats.dropped} dropped (no answer token left)"
    )


def rows_for(examples: TokenizedExamples, config) -> list[list[int]]:
    """Example indices per row: packed with the config's algorithm, or one example per row."""
    if not config.packing:
        return [[i] for i in range(len(examples))]
    return pack_examples(
        examples.segment_lengths.tolist(),
        config.seq_length,
        config.packing_algorithm,
        config.pad_seq_to_mult or 1,
        seed=config.random_seed,
    )
