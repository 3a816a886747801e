"""GPT datasets: ``GPTDataset`` over Megatron's indexed datasets, and ``MockGPTDataset``.

GPTDataset follows megatron-core's: the split's documents, repeated for as many epochs as the
requested samples need and shuffled by ``random_seed`` (the document index), are read as one token
stream; sample ``i`` is tokens ``[i x seq_length, (i + 1) x seq_length + 1)`` of it, crossing document
boundaries (the sample index); samples are visited in a seeded permutation (the shuffle index). When
the last epoch would be mostly unused it is shuffled separately, as upstream, so the early samples
see every document. The three indices are cached on disk (megatron_dataset.cached_arrays).
"""

from __future__ import annotations

import os

import numpy
import torch

from megatron_lite.core.datasets import helpers
from megatron_lite.core.datasets.blended_megatron_dataset_config import GPTDatasetConfig
from megatron_lite.core.datasets.indexed_dataset import IndexedDataset
from megatron_lite.core.datasets.megatron_dataset import MegatronDataset, cached_arrays
from megatron_lite.core.datasets.utils import Split

__all__ = ["GPTDataset", "GPTDatasetConfig", "MockGPTDataset"]

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # upstream's: a final epoch below 80 % used is shuffled apart


class GPTDataset(MegatronDataset):
    """Samples of ``sequence_length`` tokens (plus one for the labels) from ``indexed_dataset``'s
    documents ``indexed_indices``; ``num_samples`` None means one epoch."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config):
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.document_index, self.sample_index, self.shuffle_index = (
            self._build_document_sample_shuffle_indices()
        )

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        return low_level_dataset.sequence_lengths.shape[0]  # GPT splits by sequence (= document here)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self._query_document_sample_shuffle_indices(0 if idx is None else idx)).long()
        if self.config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens, labels = text, torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id
        attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            tokens,
            self.config.tokenizer.eod,
            self.config.reset_position_ids,
            self.config.reset_attention_mask,
            self.config.eod_mask_loss,
            self.config.create_attention_mask,
        )
        loss_mask[labels == self._pad_token_id] = 0.0  # padding of a last partial sample
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        return sample

    def _query_document_sample_shuffle_indices(self, idx: int) -> numpy.ndarray:
        """Sample ``idx``'s tokens: the pieces of the documents it spans, padded to full length."""
        idx = self.shuffle_index[idx]
        doc_beg, offset_beg = (int(x) for x in self.sample_index[idx])
        doc_end, offset_end = (int(x) for x in self.sample_index[idx + 1])
        extra = int(self.config.add_extra_token_to_sequence)
        parts = []
        for i in range(doc_beg, doc_end + 1):
            offset = offset_beg if i == doc_beg else 0
            length = offset_end - offset + extra if i == doc_end else None
            parts.append(self.dataset.get(int(self.document_index[i]), offset=offset, length=length))
        missing = self.config.sequence_length + extra - sum(map(len, parts))
        if missing > 0:
            parts.append(numpy.full(missing, self._pad_token_id, dtype=numpy.int64))
        return numpy.concatenate(parts, dtype=numpy.int64)

    def _cache_dir(self) -> str | None:
        if self.config.path_to_cache is not None or self.config.mock:
            return self.config.path_to_cache
        return os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")  # upstream's

    def _build_document_sample_shuffle_indices(self):
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        names = ["document_index", "sample_index", "shuffle_index"]
        return cached_arrays(self._cache_dir(), base, self.unique_description, names, self._build_indices)

    def _build_indices(self) -> list[numpy.ndarray]:
        seq, extra = self.config.sequence_length, int(self.config.add_extra_token_to_sequence)
        tokens_per_epoch = int(numpy.sum(self.dataset.sequence_lengths[self.indices]))
        num_epochs = self._get_num_epochs(tokens_per_epoch)
        separate_final_epoch = False
        if num_epochs > 1:
            sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq
            per_epoch = (tokens_per_epoch - extra) // seq
            from_final = self.num_samples - sans_final
            separate_final_epoch = from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
        rng = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, num_epochs, rng, separate_final_epoch)
        drop_last = self.index_split != Split.valid or self.config.drop_last_partial_validation_sequence
        sample_index = helpers.build_sample_idx(
            self.dataset.sequence_lengths,
            document_index,
            seq,
            num_epochs,
            tokens_per_epoch,
            drop_last,
            bool(extra),
        )
        num = sample_index.shape[0] - 1
        shuffle_index = _build_shuffle_index(sans_final if separate_final_epoch else num, num, rng)
        return [document_index, sample_index, shuffle_index]

    def _get_num_epochs(self, tokens_per_epoch: int) -> int:
        if self.num_samples is None:
            return 1
        if tokens_per_epoch <= int(self.config.add_extra_token_to_sequence):
            raise ValueError(f"{self.dataset_path}: the {self.index_split.name} split holds no tokens")
        needed = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        return max(1, -(-needed // tokens_per_epoch))


def _build_document_index(documents, num_epochs: int, rng, separate_final_epoch: bool) -> numpy.ndarray:
    """The split's documents once per epoch, shuffled (the final epoch apart when asked)."""
    if not separate_final_epoch or num_epochs == 1:
        index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        rng.shuffle(index)
        return index
    first = _build_document_index(documents, num_epochs - 1, rng, False)
    return numpy.concatenate((first, _build_document_index(documents, 1, rng, False)))


def _build_shuffle_index(num_samples: int, total_size: int, rng) -> numpy.ndarray:
    """A permutation of [0, num_samples), then one of [num_samples, total_size)."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return numpy.concatenate((first, last))


def _get_ltor_masks_and_position_ids(
    data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss, create_attention_mask
):
    """Left-to-right masks and positions: EOD tokens out of the loss, positions (and attention)
    restarted after each EOD when asked. The attention mask is True where attention is blocked."""
    n = data.numel()
    attention_mask = torch.tril(torch.ones((n, n))).unsqueeze(0) if create_attention_mask else None
    loss_mask = torch.ones(n, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(n, dtype=torch.long)
    if reset_position_ids or reset_attention_mask:
        prev = 0
        for i in position_ids[data == eod_token].tolist():
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, i + 1 :, : i + 1] = 0
            if reset_position_ids:
                position_ids[i + 1 :] -= i + 1 - prev
                prev = i + 1
    if attention_mask is not None:
        attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


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
