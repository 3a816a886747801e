"""Dataset configs of megatron.core.datasets: what data to draw and how sequences are shaped.

A config without ``blend`` or ``blend_per_split`` is mock, as upstream. ``split`` ("969,30,1") becomes
``split_matrix``, each split's [begin, end) fraction of every dataset (None for an empty split), with
upstream's arithmetic, so the same documents land in the same split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatron_lite.core.datasets.utils import normalize


@dataclass(kw_only=True)
class BlendedMegatronDatasetConfig:
    """Where samples come from and how long they are."""

    random_seed: int
    """Seed of every random choice made while building the datasets."""
    sequence_length: int
    """Tokens per sample."""
    blend: tuple[list[str], list[float] | None] | None = None
    """Indexed-dataset prefixes and optional weights, e.g. (["A", "B"], [0.3, 0.7]) (--data-path)."""
    blend_per_split: list | None = None
    """One blend (or None) per train/valid/test split (--train-data-path, ...); not with ``split``."""
    split: str | None = None
    """Comma-separated train,valid,test weights of every dataset in ``blend``; mock data uses "1,1,1"."""
    split_matrix: list[tuple[float, float] | None] | None = field(init=False, default=None)
    """Derived from ``split``: the [begin, end) fraction of each split, None where it is empty."""
    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples each blended dataset builds, so the blend never runs short."""
    num_dataset_builder_threads: int = 1
    """Threads building the datasets."""
    path_to_cache: str | None = None
    """Where reusable dataset indices are cached."""
    mmap_bin_files: bool = True
    """Memory-map the .bin files."""
    mock: bool = field(init=False, default=False)
    """Derived: True when neither ``blend`` nor ``blend_per_split`` is given."""
    tokenizer: object | None = None
    """Tokenizer for datasets that tokenize online (mock data does not)."""

    def __post_init__(self) -> None:
        self.mock = self.blend is None and not any(self.blend_per_split or [])
        if self.mock and self.split is None:
            self.split = "1,1,1"
        if self.split is not None and not any(self.blend_per_split or []):
            self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))


@dataclass(kw_only=True)
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """GPT-specific sample shaping: position ids, attention mask and loss mask."""

    reset_position_ids: bool | None = None
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool | None = None
    """Block attention across end-of-document tokens."""
    eod_mask_loss: bool | None = None
    """Exclude end-of-document tokens from the loss."""
    create_attention_mask: bool = True
    """Build the attention mask in the dataset (else the attention derives it)."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the validation split's last, partial sample (else it is padded and masked out of the loss)."""
    add_extra_token_to_sequence: bool = True
    """Draw sequence_length + 1 tokens so inputs and labels are both sequence_length long."""


def parse_and_normalize_split(split: str) -> list[float]:
    """ "99,1" -> [0.99, 0.01, 0.0] (missing splits are empty; negative weights are refused)."""
    weights = [float(x) for x in re.findall(r"[.0-9]+", split)]
    weights += [0.0] * (3 - len(weights))
    if len(weights) != 3 or not sum(weights) > 0:
        raise ValueError(f"--split {split!r}: give up to three non-negative weights, not all zero")
    return normalize(weights)


def convert_split_vector_to_split_matrix(vector: list[float]) -> list[tuple[float, float] | None]:
    """[0.99, 0.01, 0.0] -> [(0, 0.99), (0.99, 1.0), None]: cumulative book-ends, None when empty."""
    bounds = [0.0]
    for w in vector:
        bounds.append(bounds[-1] + w)
    return [(a, b) if b > a else None for a, b in zip(bounds[:-1], bounds[1:])]
