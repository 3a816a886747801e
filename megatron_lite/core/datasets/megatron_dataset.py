"""MegatronDataset: the base of the mid-level datasets, and their on-disk index cache.

A dataset is identified by a JSON description of its class, path, sample count, split and the config
fields that shape it (upstream's ``unique_identifiers``); the MD5 of that description prefixes every
cached index file, so a cache built for another config is never picked up. Cached arrays are written
under temporary names and renamed, the description last, so a crash leaves no half cache behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable

import numpy
import torch

from megatron_lite.core.datasets.utils import DataFileError, Split
from megatron_lite.utils.atomic_io import atomic_write_bytes

_PAD_TOKEN_ID = -1


class MegatronDataset(torch.utils.data.Dataset):
    """Upstream's constructor: ``(dataset, dataset_path, indices, num_samples, index_split, config)``."""

    def __init__(
        self, dataset, dataset_path: str | None, indices, num_samples: int | None, index_split: Split, config
    ):
        self.dataset, self.dataset_path, self.indices = dataset, dataset_path, indices
        self.num_samples, self.index_split, self.config = num_samples, index_split, config
        ids = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = dataset_path
        ids["num_samples"] = num_samples
        ids["index_split"] = index_split.name
        for attr in self._key_config_attributes():
            ids[attr] = getattr(config, attr)
        self.unique_identifiers = ids
        self.unique_description = json.dumps(ids, indent=4, default=lambda obj: obj.unique_identifiers)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        pad = getattr(config.tokenizer, "pad", None)
        # A pad id that is also the end-of-document id would mask real tokens: use -1, as upstream.
        self._pad_token_id = (
            pad if pad is not None and pad != getattr(config.tokenizer, "eod", None) else _PAD_TOKEN_ID
        )

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]


def _load_cached(path: str) -> numpy.ndarray:
    try:
        array = numpy.load(path, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError, EOFError) as err:  # numpy's words for a file that is not an array
        reason = str(err).split(". ")[0].splitlines()[0][:120]
        raise DataFileError(
            f"{path}: not a readable index cache ({reason}); remove it and the files beside it with the "
            "same prefix to rebuild them"
        ) from None
    if array.dtype.kind not in "iu":
        raise DataFileError(
            f"{path}: an index cache of {array.dtype} values, not indices; remove it to rebuild"
        )
    return array


def cached_arrays(
    path_to_cache: str | None, base: str, description: str, names: list[str], build: Callable[[], list]
) -> list[numpy.ndarray]:
    """Arrays ``names`` from ``{path_to_cache}/{base}-{name}.npy`` when the cache holds exactly this
    ``description``; else ``build()`` them and write them there (when a cache path is given)."""
    if path_to_cache is None:
        return build()
    path = lambda suffix: os.path.join(path_to_cache, f"{base}-{suffix}")  # noqa: E731
    files = [path(f"{name}.npy") for name in names]
    if os.path.isfile(path("description.txt")) and all(map(os.path.isfile, files)):
        with open(path("description.txt")) as f:
            if f.read() == description:
                return [_load_cached(p) for p in files]
    arrays = build()
    os.makedirs(path_to_cache, exist_ok=True)
    for file, array in zip(files, arrays):
        atomic_write_bytes(file, lambda f, a=array: numpy.save(f, a, allow_pickle=False), array.nbytes)
    atomic_write_bytes(path("description.txt"), lambda f: f.write(description.encode("utf-8")))
    return arrays
