"""What every dataset section shares, Megatron-Bridge's ``megatron.bridge.data.base``: the loader
settings (``DataloaderConfig``) and the contract of a custom dataset (``DatasetProvider``, built with
a ``DatasetBuildContext``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class DataloaderConfig:
    """How samples are batched into microbatches."""

    dataloader_type: str | None = "single"
    """single: each sample once, in order, resumable at any consumed-sample count (the only kind)."""
    num_workers: int = 2
    """Data-loader worker processes per iterator (0: read in the training process)."""

    def finalize(self) -> None:
        """Nothing to derive; the type is checked by ConfigContainer.validate."""


@dataclass(frozen=True)
class DatasetBuildContext:
    """What the training set-up tells a dataset provider: samples per split (as
    ``get_train_valid_test_num_samples``), the tokenizer and the process groups."""

    train_samples: int
    valid_samples: int
    test_samples: int
    tokenizer: Any | None = None
    pg_collection: Any | None = None


@dataclass
class DatasetProvider(DataloaderConfig, ABC):
    """A custom dataset as ``ConfigContainer.dataset``: set-up calls :meth:`build_datasets` on every
    rank. Each sample is what the GPT step reads from megatron_lite's datasets: a dict of
    ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` of the model's ``seq_length``."""

    @abstractmethod
    def build_datasets(self, context: DatasetBuildContext) -> tuple[Any | None, Any | None, Any | None]:
        """The train, validation and test datasets (None for a split not built)."""
        raise NotImplementedError
