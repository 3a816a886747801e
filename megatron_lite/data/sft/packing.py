"""Packing SFT examples into rows of ``seq_length`` positions: the bin-packing algorithms (Megatron-Bridge's
``first_fit`` / ``first_fit_decreasing`` / ``first_fit_shuffle``, same names and results) and the
building of one row with its boundaries.

A row is the shared contract's sample: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` of
``[s]``, ``cu_seqlens`` (int32 ``[s + 2]``: the boundaries, then -1), ``cu_seqlens_argmin`` (how many
boundaries are real) and ``max_seqlen``. Each example of L ids takes L - 1 positions (inputs ids[:-1],
labels ids[1:], Bridge's shift), so no label crosses into the next example; the pad tail is a segment
of its own, masked, its positions restarting at 0. With ``pad_seq_to_mult`` > 1 each example's segment
is padded to a multiple of it (Bridge's CP / SP alignment; the padding masked, positions continuing) and
the row also carries ``cu_seqlens_unpadded`` (the cumulative real lengths) and its argmin.
"""

from __future__ import annotations

import numpy as np
import torch

PACKING_ALGOS = ("first_fit_decreasing", "first_fit_shuffle")


def first_fit(seqlens, pack_size: int, *, item_lengths=None) -> list[list]:
    """Each entry into the first bin it fits (bins opened in order), as Bridge's ``first_fit``; the
    entries are their own lengths unless ``item_lengths`` gives them. O(n log n): a max-tree over the
    bins' free space, where every bin not yet opened has all of ``pack_size`` free."""
    lengths = list(seqlens if item_lengths is None else item_lengths)
    if item_lengths is not None and len(seqlens) != len(lengths):
        raise ValueError(f"seqlens and item_lengths differ in length ({len(seqlens)} vs {len(lengths)})")
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    free = [pack_size] * (2 * size)
    bins: list[list] = []
    for item, length in zip(seqlens, lengths):
        if length > pack_size:
            raise ValueError(f"an entry of length {length} does not fit in a pack of {pack_size}")
        node = 1
        while node < size:  # the leftmost bin with room
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        index = node - size
        if index == len(bins):
            bins.append([])
        bins[index].append(item)
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def first_fit_decreasing(seqlens, pack_size: int, *, item_lengths=None) -> list[list]:
    """First fit over the entries sorted longest first (a stable sort: ties keep their order)."""
    if item_lengths is None:
        return first_fit(sorted(seqlens, reverse=True), pack_size)
    order = sorted(range(len(seqlens)), key=lambda i: item_lengths[i], reverse=True)
    return first_fit([seqlens[i] for i in order], pack_size, item_lengths=[item_lengths[i] for i in order])


def first_fit_shuffle(seqlens, pack_size: int, *, item_lengths=None, seed: int = 0) -> list[list]:
    """First fit over the entries in a random order, reproducible from ``seed`` (Bridge's draws
    from numpy's global generator)."""
    order = np.random.default_rng(seed).permutation(len(seqlens))
    lengths = None if item_lengths is None else [item_lengths[i] for i in order]
    return first_fit([seqlens[i] for i in order], pack_size, item_lengths=lengths)


def aligned(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def pack_examples(lengths, seq_length: int, algorithm: str, pad_seq_to_mult: int = 1, seed: int = 0):
    """Example indices per pack: ``lengths`` are the examples' segment lengths (each aligned to
    ``pad_seq_to_mult`` before packing); packs keep their examples in index order."""
    if algorithm not in PACKING_ALGOS:
        raise ValueError(f"packing algorithm {algorithm!r}: choose from {', '.join(PACKING_ALGOS)}")
    sizes = [aligned(n, pad_seq_to_mult) for n in lengths]
    indices = list(range(len(sizes)))
    if algorithm == "first_fit_decreasing":
        bins = first_fit_decreasing(indices, seq_length, item_lengths=sizes)
    else:
        bins = first_fit_shuffle(indices, seq_length, item_lengths=sizes, seed=seed)
    return [sorted(b) for b in bins]


def _boundaries(ends: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.full((length,), -1, dtype=torch.int32)
    cu[: len(ends)] = torch.tensor(ends, dtype=torch.int32)
    return cu, torch.tensor(len(ends), dtype=torch.int64)


def build_row(examples, seq_length: int, pad_id: int, pad_seq_to_mult: int = 1) -> dict[str, torch.Tensor]:
    """One sample of ``seq_length`` positions from ``examples`` (``(ids, answer)`` array pairs, in row
    order); their aligned segments must fit."""
    s = seq_length
    tokens = np.full(s, pad_id, np.int64)
    labels = np.full(s, pad_id, np.int64)
    loss_mask = np.zeros(s, np.float32)
    position_ids = np.zeros(s, np.int64)
    ends, real_ends = [0], [0]
    offset = 0
    for ids, answer in examples:
        n = len(ids) - 1
        segment = aligned(n, pad_seq_to_mult)
        if offset + segment > s:
            raise ValueError(f"examples of {offset + segment} positions do not fit in a row of {s}")
        tokens[offset : offset + n] = ids[:-1]
        labels[offset : offset + n] = ids[1:]
        loss_mask[offset : offset + n] = answer[1:]
        position_ids[offset : offset + segment] = np.arange(segment)
        offset += segment
        ends.append(offset)
        real_ends.append(real_ends[-1] + n)
    if offset < s:  # the pad tail: its own segment, so no example attends to it or it to one
        position_ids[offset:] = np.arange(s - offset)
        ends.append(s)
        real_ends.append(real_ends[-1] + s - offset)
    cu_seqlens, argmin = _boundaries(ends, s + 2)
    row = {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(position_ids),
        "cu_seqlens": cu_seqlens,
        "cu_seqlens_argmin": argmin,
        "max_seqlen": torch.tensor(max(np.diff(ends)), dtype=torch.int32),
    }
    if pad_seq_to_mult > 1:
        row["cu_seqlens_unpadded"], row["cu_seqlens_unpadded_argmin"] = _boundaries(real_ends, s + 2)
    return row
