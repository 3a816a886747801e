"""Packed sequences (the ``thd`` format), as megatron.core.packed_seq_params.

A packed row holds several examples one after another; ``cu_seqlens`` gives their cumulative
boundaries ``[0, end_0, end_1, ..., total]``. Attention then stays within each example and RoPE
restarts its positions at each example. megatron_lite keeps the ``[s, b, h]`` activations with one
packed row per micro batch (``b == 1``, as Megatron-Bridge requires) rather than squeezing the batch
dimension away.

Under context parallelism each example (padded to a multiple of ``2 cp``) is cut into ``2 cp``
chunks and CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of every example, in order
(Transformer Engine's ``thd_get_partitioned_indices``, which megatron-core's
``get_thd_batch_on_this_cp_rank`` uses): each rank holds ``1 / cp`` of every example, so its local
boundaries are the global ones divided by ``cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedSeqParams:
    """Parameters of a packed (``thd``) batch, upstream's fields. The ``*_padded`` boundaries are
    where the examples sit in the row (each example padded, e.g. to a multiple of ``2 cp``); the
    unpadded ones say how many of those tokens are real. Padding sits at an example's end, so under
    causal attention no real token sees it: megatron_lite attends within the padded boundaries."""

    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None


def physical_cu_seqlens(params: PackedSeqParams) -> torch.Tensor:
    """The boundaries the tokens are laid out by: the padded ones where given."""
    if params.qkv_format not in (None, "thd"):
        raise ValueError(
            f"packed_seq_params.qkv_format is {params.qkv_format!r}; megatron_lite packs 'thd' only"
        )
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    if cu is None:
        raise ValueError("packed_seq_params has neither cu_seqlens_q_padded nor cu_seqlens_q")
    kv = params.cu_seqlens_kv_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_kv
    if kv is not None and kv is not cu and _values(kv) != _values(cu):
        raise ValueError("packed self-attention needs the same query and key/value boundaries (cu_seqlens)")
    return cu


def _values(cu_seqlens: torch.Tensor) -> list[int]:
    """The tensor's values read on the host before any torch op on it: the dry run's fake-tensor mode
    would turn an op's result into a tensor without values (the boundaries are host metadata)."""
    values = cu_seqlens.tolist()
    while values and isinstance(values[0], list):  # a leading batch dimension of one row
        values = values[0]
    return values


def boundaries(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """``cu_seqlens`` as Python ints without the ``-1`` fill after the real boundaries (Megatron-LM's
    collatable form), ending at ``total``: tokens past the last boundary are one more example (the
    pack's padding tail)."""
    cu = [v for v in _values(cu_seqlens) if v >= 0]
    if not cu or cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {_values(cu_seqlens)}")
    if any(b < a for a, b in zip(cu[:-1], cu[1:])) or cu[-1] > total:
        raise ValueError(f"cu_seqlens must rise from 0 to at most the {total} packed tokens, got {cu}")
    return cu + [total] if cu[-1] < total else cu


def segment_boundaries(params: PackedSeqParams, total: int) -> list[int]:
    """The examples' global boundaries ``[0, ..., total]`` (one host read a forward: cached on
    ``params``, which a forward step builds afresh for each micro batch)."""
    cache = params.__dict__.setdefault("_boundaries", {})
    if total not in cache:
        cache[total] = boundaries(physical_cu_seqlens(params), total)
    return cache[total]


def check_cp_divisible(bounds: list[int], cp_size: int) -> None:
    """Under context parallelism every example must split into ``2 cp`` equal chunks (Bridge's rule:
    pad each example to a multiple of ``2 cp``, ``2 cp tp`` with sequence parallelism)."""
    if cp_size == 1:
        return
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if (end - start) % (2 * cp_size):
            raise ValueError(
                f"packed example {i} is {end - start} tokens long; with --context-parallel-size "
                f"{cp_size} each example must be padded to a multiple of {2 * cp_size} (2 x cp)"
            )


def _rank_ranges(bounds: list[int], cp_size: int, cp_rank: int):
    """(example start, first, end) offsets within each example of the tokens this CP rank holds."""
    check_cp_divisible(bounds, cp_size)
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp_size)
        if cp_size == 1:
            yield start, 0, end - start
            continue
        yield start, cp_rank * chunk, (cp_rank + 1) * chunk
        yield start, (2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk


def _ranges(parts, device) -> torch.Tensor:
    pieces = [torch.arange(a, b, device=device) for a, b in parts if b > a]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


def thd_partitioned_indices(cu_seqlens: torch.Tensor, total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions in the whole packed row that CP rank ``cp_rank`` holds (chunks ``r`` and
    ``2 cp - 1 - r`` of each example), in order; all ``total`` positions when ``cp_size`` is 1."""
    bounds = boundaries(cu_seqlens, total)
    parts = [(s + a, s + b) for s, a, b in _rank_ranges(bounds, cp_size, cp_rank)]
    return _ranges(parts, cu_seqlens.device)


def thd_position_ids(
    cu_seqlens: torch.Tensor, total: int, cp_size: int = 1, cp_rank: int = 0, device=None
) -> torch.Tensor:
    """Each of this CP rank's tokens' position within its example (0 at each example's start)."""
    bounds = boundaries(cu_seqlens, total)
    parts = [(a, b) for _, a, b in _rank_ranges(bounds, cp_size, cp_rank)]
    return _ranges(parts, cu_seqlens.device if device is None else device)
