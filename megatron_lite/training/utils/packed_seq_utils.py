"""Packed-sequence metadata of a batch, as Megatron-Bridge's ``training/utils/packed_seq_utils.py``.

An SFT sample carries its examples' boundaries as ``cu_seqlens`` (int32, padded to a fixed length per
dataset with -1 after the real boundaries so samples collate, Megatron-LM's sft_dataset convention) and
``max_seqlen``. ``get_packed_seq_params`` turns them into the model's ``PackedSeqParams`` (THD), the
-1 padding stripped; ``batches_carry_boundaries`` says from the config alone whether a run's batches
have them, which is what lets a middle pipeline stage know it must read its batch (Bridge #2952).
"""

from __future__ import annotations

import torch

from megatron_lite.core.packed_seq_params import PackedSeqParams


def _boundaries(cu_seqlens: torch.Tensor, argmin=None) -> list[int]:
    """One row's real boundaries: the first ``argmin`` entries (Bridge's ``cu_seqlens_argmin``, the
    count of real entries), else those before the first negative one (the -1 padding). One host read
    of the tensor as given (the data loader hands it over on the CPU, so no device sync; and no torch
    op before it, which the dry run's fake-tensor mode would turn into a tensor without values)."""
    values = cu_seqlens.tolist()
    values = values[0] if values and isinstance(values[0], list) else values
    if argmin is not None:
        end = _first(argmin)
    else:
        end = next((i for i, v in enumerate(values) if v < 0), len(values))
    return values[:end]


def _first(value) -> int:
    """A per-row scalar (a number, a 0-d tensor or a batch of one) as an int, read as ``_boundaries`` reads."""
    values = value.tolist() if torch.is_tensor(value) else value
    return int(values[0] if isinstance(values, list) else values)


def _host_tensor(values: list[int]) -> torch.Tensor:
    """``values`` as an int32 CPU tensor, a real one even under the dry run's fake-tensor mode: the
    boundaries are host metadata the attention reads back as numbers."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.tensor(values, dtype=torch.int32)


def rows_of(batch: dict[str, torch.Tensor]) -> int:
    """How many rows (samples) the batch's ``cu_seqlens`` describe: 1 for a single [n+1] row."""
    cu_seqlens = batch["cu_seqlens"]
    return cu_seqlens.size(0) if cu_seqlens.dim() > 1 else 1


def get_packed_seq_params(batch: dict[str, torch.Tensor]) -> PackedSeqParams:
    """``PackedSeqParams`` (qkv_format "thd", the same boundaries for queries and keys) of a batch
    holding one packed row's ``cu_seqlens`` ([n+1] or [1, n+1], -1 padded; ``cu_seqlens_argmin``
    used when present) and ``max_seqlen`` (else the longest segment). As Bridge's legacy branch: with
    ``cu_seqlens_unpadded`` (each example padded, e.g. for CP / SP) the unpadded ends are
    ``cu_seqlens_q`` / ``_kv`` and the physical ones the ``*_padded``; without, the padded variants
    are None."""
    if rows_of(batch) != 1:
        raise ValueError(
            f"packed sequences need --micro-batch-size 1 (as Megatron-Bridge); got a batch of "
            f"{rows_of(batch)} packed rows"
        )
    padded = _boundaries(batch["cu_seqlens"], batch.get("cu_seqlens_argmin"))
    unpadded = batch.get("cu_seqlens_unpadded")
    if unpadded is not None:
        unpadded = _boundaries(unpadded, batch.get("cu_seqlens_unpadded_argmin"))
    max_seqlen = batch.get("max_seqlen")
    if max_seqlen is None:
        max_seqlen = max((b - a for a, b in zip(padded[:-1], padded[1:])), default=0)
    else:
        max_seqlen = _first(max_seqlen)
    padded = _host_tensor(padded)
    cu = padded if unpadded is None else _host_tensor(unpadded)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=None if unpadded is None else padded,
        cu_seqlens_kv_padded=None if unpadded is None else padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def batches_carry_boundaries(cfg) -> bool:
    """Whether the run's batches carry ``cu_seqlens``: its dataset config says ``sft`` (Megatron-LM's
    ``args.sft``; the SFT dataset config's property, packed or not). Decided from the config alone,
    identically on every rank, so a middle pipeline stage knows before reading whether it must read
    its batch."""
    return bool(getattr(getattr(cfg, "dataset", None), "sft", False))
