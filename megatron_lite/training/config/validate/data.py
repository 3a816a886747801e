"""Checks of the data and tokenizer sections against the files they name, run by validate.

They run in the launcher before any worker starts, so a missing ``.bin`` / ``.idx``, a split that
leaves a dataset's split without documents or a missing tokenizer file is one ConfigError naming the
flag, never a traceback from a rank. They read the files (the ``.idx`` headers, the tokenizer) and
write nothing. ``resolve_vocab_size`` is the one derivation: the model's vocabulary follows the
tokenizer, with Megatron-Bridge's rule (``_validate_and_set_vocab_size``).
"""

from __future__ import annotations

import os

from megatron_lite.core.datasets.indexed_dataset import get_bin_path, get_idx_path
from megatron_lite.core.datasets.utils import Split
from megatron_lite.training.errors import ConfigError
from megatron_lite.training.tokenizers import get_tokenizer

_PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def resolve_vocab_size(cfg) -> None:
    """model.vocab_size from the tokenizer: its size with ``use_tokenizer_vocab_size`` (the CLI, as
    Megatron-LM) or when the model has none; else the model's, which must hold every token id."""
    tokenizer = get_tokenizer(cfg)
    if tokenizer is None:
        return
    size, m = tokenizer.vocab_size, cfg.model
    if cfg.tokenizer.use_tokenizer_vocab_size or m.vocab_size is None:
        m.vocab_size = size
    elif m.vocab_size < size:
        raise ConfigError(
            "--vocab-size",
            f"model vocab_size ({m.vocab_size}) cannot be smaller than the tokenizer's vocab_size ({size})",
        )


def check_data(cfg) -> None:
    """Real data: a tokenizer, every prefix's files, and documents in every split that is built."""
    ds = cfg.dataset
    if not hasattr(ds, "mock") or ds.mock:  # a custom DatasetProvider checks its own data
        return
    if ds.blend is not None:
        for prefix in ds.blend[0]:
            documents = _documents("--data-path", prefix)
            for i, bounds in enumerate(ds.split_matrix):
                if bounds is not None and round(bounds[1] * documents) == round(bounds[0] * documents):
                    raise ConfigError(
                        "--split",
                        f"{ds.split!r} leaves the {Split(i).name} split of {prefix} without documents (it "
                        f"has {documents}); give that split a larger share, or 0",
                    )
    for flag, blend in zip(_PER_SPLIT_FLAGS, ds.blend_per_split or []):
        for prefix in blend[0] if blend else []:
            if _documents(flag, prefix) == 0:
                raise ConfigError(flag, f"{prefix} holds no documents")
    if cfg.tokenizer.tokenizer_type is None:
        raise ConfigError(
            "--tokenizer-type",
            "is required with real data: the datasets need its end-of-document id and the model its "
            "vocabulary (e.g. GPT2BPETokenizer with --vocab-file and --merge-file)",
        )


def _documents(flag: str, prefix: str) -> int:
    """The number of sequences (GPT's documents) in ``prefix``'s index, read from its header."""
    missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not os.path.isfile(p)]
    if missing:
        raise ConfigError(
            flag,
            f"{' and '.join(missing)} not found: give the prefix of an indexed dataset, as "
            "tools/preprocess_data.py writes it (<output-prefix>_text_document)",
        )
    from megatron_lite.core.datasets.indexed_dataset import IndexedDataset

    try:
        dataset = IndexedDataset(prefix, mmap=False)
        dataset.check()
        return len(dataset)
    except (OSError, ValueError) as err:
        raise ConfigError(flag, f"{prefix}: {err}") from None
