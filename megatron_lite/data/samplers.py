"""Megatron's pretraining sampler and the data loader built on it."""

from __future__ import annotations

import torch


class MegatronPretrainingSampler:
    """Yields this data-parallel rank's microbatches of indices, in order, from ``consumed_samples``.

    Each run of ``micro_batch_size x data_parallel_size`` consecutive samples is split across the
    data-parallel ranks, so the global batch is the same whatever the layout.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0 or consumed_samples >= total_samples:
            raise ValueError(f"no samples left: consumed {consumed_samples} of {total_samples}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self):
        span = self.micro_batch_size * self.data_parallel_size
        start = self.data_parallel_rank * self.micro_batch_size
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == span:
                yield batch[start : start + self.micro_batch_size]
                batch = []
        if batch and not self.drop_last:
            yield batch[start : start + self.micro_batch_size]


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
):
    """A DataLoader over ``dataset`` that resumes exactly at ``consumed_samples``. Workers, when
    asked for, each read whole microbatches; the loader still yields them in the sampler's order."""
    sampler = MegatronPretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
    )
    # A private generator: creating the iterator would otherwise draw from the global RNG and shift
    # the dropout stream of a resumed run.
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),
        persistent_workers=False,
    )
