"""NumPy ports of megatron-core's C++ dataset helpers (helpers.cpp), same results element for element.

``build_sample_idx``: sample ``i`` of a GPT dataset starts at token ``i x seq_length`` of the documents
concatenated in document-index order; its row is (position in the document index, offset in that
document) of that token, as the C++ records it. The C++ walks the documents; here one ``searchsorted`` over cumulative
document lengths finds every start at once. ``build_blending_indices`` is the same greedy loop as
upstream's: each next sample goes to the dataset furthest behind its weight.
"""

from __future__ import annotations

import math

import numpy


def build_sample_idx(
    sizes: numpy.ndarray,
    document_indices: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> numpy.ndarray:
    """The ``[num_samples + 1, 2]`` sample index (int32 when it fits, as upstream)."""
    extra = int(add_extra_token_to_sequence)
    total = num_epochs * tokens_per_epoch - extra
    num_samples = (
        total // sequence_length if drop_last_partial_sequence else math.ceil(total / sequence_length)
    )
    lengths = sizes[document_indices].astype(numpy.int64)
    ends = numpy.cumsum(lengths)  # ends[j]: tokens up to and including document_indices[j]
    starts = numpy.arange(num_samples + 1, dtype=numpy.int64) * sequence_length
    # The C++ stops in the first document j whose end reaches the sample's end, starts + seq_length +
    # extra: ends[j] > start with the extra token, ends[j] >= start without (empty documents never win).
    doc = numpy.searchsorted(ends, starts, side="right" if extra else "left")
    past_end = doc >= len(lengths)  # only the last, partial sample of drop_last=False
    doc = numpy.minimum(doc, len(lengths) - 1)
    offset = starts - (ends[doc] - lengths[doc])
    offset[past_end] = lengths[-1] - extra  # where the C++ stops: the last document's end
    sample_idx = numpy.stack([doc, offset], axis=1)
    sample_idx[0] = 0  # the first sample starts at (0, 0) even when leading documents are empty
    dtype = (
        numpy.int32
        if max(len(document_indices), int(sizes.max())) <= numpy.iinfo(numpy.int32).max
        else numpy.int64
    )
    return sample_idx.astype(dtype)


def build_blending_indices(
    weights: list[float], num_datasets: int, size: int
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """``(dataset_index int16, dataset_sample_index int64)`` of ``size`` samples blended by ``weights``."""
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
    current = [0] * num_datasets
    for i in range(size):
        scale = max(float(i), 1.0)
        errors = [weights[d] * scale - current[d] for d in range(num_datasets)]
        best = max(range(num_datasets), key=lambda d: (errors[d], -d))  # first maximum, as the C++
        dataset_index[i], dataset_sample_index[i] = best, current[best]
        current[best] += 1
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: list[int]) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Every sample of every dataset exactly once (``sizes[i]`` of dataset ``i``), interleaved by size."""
    total = sum(sizes)
    weights = [n / float(total) for n in sizes]
    dataset_index = numpy.zeros(total, dtype=numpy.int16)
    dataset_sample_index = numpy.zeros(total, dtype=numpy.int64)
    counts = [0] * len(sizes)
    unspent = [d for d, n in enumerate(sizes) if n > 0]
    for i in range(total):
        scale = max(float(i), 1.0)
        best = max(unspent, key=lambda d: (weights[d] * scale - counts[d], -d))
        dataset_index[i], dataset_sample_index[i] = best, counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, dataset_sample_index
