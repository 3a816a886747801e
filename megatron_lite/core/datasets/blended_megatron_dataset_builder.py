"""BlendedMegatronDatasetBuilder: the train / valid / test datasets of a config, as megatron-core builds them.

``config.blend`` + ``config.split``: every prefix is split by document into the split matrix's
fractions; with several prefixes (or weights) each split is a BlendedDataset of the prefixes' parts,
each part built with ``mid_level_dataset_surplus`` more samples than its weight asks so the blend
never runs short. ``config.blend_per_split``: each split has its own blend, taken whole.
In a distributed run rank 0 builds first (writing the index caches) and the other ranks then load them.
"""

from __future__ import annotations

import math

import numpy
import torch

from megatron_lite.core.datasets.blended_dataset import BlendedDataset
from megatron_lite.core.datasets.utils import Split, normalize


class BlendedMegatronDatasetBuilder:
    """``build()`` -> ``[train, valid, test]`` (None where a split is empty); ``sizes`` are the
    samples wanted per split (None: one epoch of that split)."""

    def __init__(self, cls, sizes: list[int | None], is_built_on_rank, config) -> None:
        self.cls, self.sizes, self.is_built_on_rank, self.config = cls, sizes, is_built_on_rank, config
        if config.mock:
            raise ValueError("mock data has no indexed dataset to build: use MockGPTDataset")

    def build(self) -> list:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not distributed or torch.distributed.get_world_size() == 1:
            return self._build_blended_dataset_splits()
        first = torch.distributed.get_rank() == 0
        datasets = self._build_blended_dataset_splits() if first else None
        torch.distributed.barrier()  # the caches exist now; the other ranks only read them
        return datasets if first else self._build_blended_dataset_splits()

    def _build_blended_dataset_splits(self) -> list:
        if self.config.blend:
            prefixes, weights = self.config.blend
            return self._build_blend(prefixes, weights, self.config.split_matrix, self.sizes)
        datasets = [None] * len(Split)
        for i, blend in enumerate(self.config.blend_per_split):
            if blend is not None:
                split, sizes = [None] * len(Split), [0] * len(Split)
                split[i], sizes[i] = (0.0, 1.0), self.sizes[i]
                datasets[i] = self._build_blend(blend[0], blend[1], split, sizes)[i]
        return datasets

    def _build_blend(self, prefixes: list[str], weights: list[float] | None, split, sizes) -> list:
        if len(prefixes) == 1 and weights is None:
            return self._build_megatron_dataset_splits(prefixes[0], split, sizes)
        if weights is not None:
            weights = normalize(weights)
            target = _get_size_per_split_per_dataset(weights, sizes)
            buffer = _get_size_per_split_per_dataset(weights, sizes, self.config.mid_level_dataset_surplus)
        else:
            buffer = [[None] * len(Split) for _ in prefixes]
        parts = [self._build_megatron_dataset_splits(p, split, buffer[j]) for j, p in enumerate(prefixes)]
        blended = [None] * len(Split)
        for i in range(len(Split)):
            if split[i] is None:
                continue
            if weights is not None:
                weights_i, size_i = weights, sum(target[j][i] for j in range(len(prefixes)))
            else:  # in proportion to the parts' lengths, capped at what they hold
                weights_i = [len(part[i]) for part in parts]
                size_i = None if sizes[i] is None else min(sizes[i], sum(weights_i))
            blended[i] = BlendedDataset([part[i] for part in parts], weights_i, size_i, self.config)
        return blended

    def _build_megatron_dataset_splits(self, dataset_path: str, split, sizes) -> list:
        """One mid-level dataset per non-empty split, over its [begin, end) fraction of the documents."""
        low_level = self.cls.build_low_level_dataset(dataset_path, self.config)
        n = self.cls.numel_low_level_dataset(low_level)
        datasets = []
        for i, bounds in enumerate(split):
            if bounds is None:
                datasets.append(None)
                continue
            beg, end = int(round(bounds[0] * float(n))), int(round(bounds[1] * float(n)))
            indices = numpy.arange(beg, end, dtype=numpy.int32)
            datasets.append(self.cls(low_level, dataset_path, indices, sizes[i], Split(i), self.config))
        return datasets


def _get_size_per_split_per_dataset(
    weights: list[float], sizes: list[int], surplus: float = 0.0
) -> list[list[int]]:
    """Samples each dataset contributes to each split: ceil(ceil(size x weight) x (1 + surplus))."""
    return [[int(math.ceil(math.ceil(size * w) * (1 + surplus))) for size in sizes] for w in weights]
