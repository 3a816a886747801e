"""BlendedDataset: several mid-level datasets drawn in proportion to their weights (megatron-core's).

Sample ``i`` comes from dataset ``dataset_index[i]``, as that dataset's ``dataset_sample_index[i]``-th
sample; helpers.build_blending_indices keeps every prefix of the blend as close to the weights as
integers allow. The two indices are cached like the GPT indices, under the blend's own hash.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

import numpy
import torch

from megatron_lite.core.datasets import helpers
from megatron_lite.core.datasets.megatron_dataset import cached_arrays
from megatron_lite.core.datasets.utils import normalize


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples from ``datasets`` by ``weights``; ``size`` None draws ``weights[i]`` (integers)
    samples of dataset ``i``, each exactly once."""

    def __init__(self, datasets: list, weights: list[float], size: int | None, config) -> None:
        if len(datasets) != len(weights) or not all(w > 0 for w in weights):
            raise ValueError("BlendedDataset needs one positive weight per dataset")
        if len({d.index_split for d in datasets}) != 1:
            raise ValueError("BlendedDataset blends datasets of one split")
        self.datasets, self.split, self.config = datasets, datasets[0].index_split, config
        self.weights = normalize(weights) if size is not None else weights
        self.size = size
        ids = OrderedDict()
        ids["class"] = type(self).__name__
        ids["datasets"] = [d.unique_identifiers for d in datasets]
        ids["split"] = self.split.name
        ids["weights"] = self.weights
        ids["size"] = self.size
        self.unique_identifiers = ids
        self.unique_description = json.dumps(ids, indent=4, default=lambda obj: obj.unique_identifiers)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
        names = ["dataset_index", "dataset_sample_index"]
        self.dataset_index, self.dataset_sample_index = cached_arrays(
            config.path_to_cache, base, self.unique_description, names, self._build_indices
        )

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> dict:
        dataset_id = int(self.dataset_index[idx])
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][int(self.dataset_sample_index[idx])]}

    def _build_indices(self) -> list[numpy.ndarray]:
        if self.size is not None:
            dataset_index, sample_index = helpers.build_blending_indices(
                self.weights, len(self.datasets), self.size
            )
        else:  # each dataset's samples exactly once, in blend order
            counts = [int(w) for w in self.weights]
            dataset_index, sample_index = helpers.build_exhaustive_blending_indices(counts)
        used = numpy.bincount(dataset_index, minlength=len(self.datasets))
        for i, (dataset, n) in enumerate(zip(self.datasets, used)):
            if len(dataset) < n:
                raise IndexError(
                    f"The {self.split.name} blend oversamples the contributing datasets and, for example, "
                    f"requests {n} samples from {type(dataset).__name__} number {i} in excess of its size "
                    f"{len(dataset)}; raise mid_level_dataset_surplus"
                )
        return [dataset_index, sample_index]
