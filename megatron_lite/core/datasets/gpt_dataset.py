"""MockGPTDataset: deterministic synthetic token sequences, for runs without data on disk."""

from __future__ import annotations

import torch

from megatron_lite.core.datasets.blended_megatron_dataset_config import GPTDatasetConfig  # noqa: F401


class MockGPTDataset(torch.utils.data.Dataset):
    """Sample ``i`` is an arithmetic token sequence ``(start + stride * t) mod vocab`` whose start and
    stride come from ``(seed, i)``. The same index gives the same sample on every rank and layout, and
    the pattern is learnable, so a training run's loss visibly falls."""

    def __init__(
        self, *, vocab_size: int, sequence_length: int, seed: int, num_samples: int, max_stride: int = 7
    ):
        self.vocab_size, self.sequence_length = vocab_size, sequence_length
        self.seed, self.num_samples, self.max_stride = seed, num_samples, max_stride

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(idx)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        start = torch.randint(self.vocab_size, (1,), generator=g)
        stride = torch.randint(1, self.max_stride + 1, (1,), generator=g)
        text = (start + stride * torch.arange(self.sequence_length + 1)) % self.vocab_size
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.sequence_length, dtype=torch.float32),
            "position_ids": torch.arange(self.sequence_length),
        }
