"""Dataset utilities of megatron.core.datasets.utils: splits, weight normalization, blend lists."""

from __future__ import annotations

from enum import Enum

import numpy


class DataFileError(ValueError):
    """A data file (``.idx``, ``.bin``, an index cache) that cannot be used as it is; ``str(err)`` is
    one line naming the file and what is wrong with it."""


class Split(Enum):
    train = 0
    valid = 1
    test = 2


def normalize(weights: list[float]) -> list[float]:
    """Weights divided by their sum (float64, as upstream, so derived sizes and hashes agree)."""
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


def get_blend_from_list(blend: list[str] | None) -> tuple[list[str], list[float] | None] | None:
    """``["0.3", "A", "0.7", "B"]`` -> ``(["A", "B"], [0.3, 0.7])``; ``["A", "B"]`` -> ``(["A", "B"], None)``."""
    if blend is None:
        return None
    if len(blend) % 2 == 1:
        return [p.strip() for p in blend], None
    raw_weights, prefixes = blend[0::2], blend[1::2]
    try:
        weights = [float(w) for w in raw_weights]
    except ValueError:
        return [p.strip() for p in blend], None  # an even number of prefixes without weights
    return [p.strip() for p in prefixes], weights
