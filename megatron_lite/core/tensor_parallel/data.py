"""Broadcast a batch from the first rank of each tensor-parallel group to the others, as
megatron.core.tensor_parallel.data."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.process_group_utils import (
    get_collective_device,
    get_pg_rank,
    get_tensor_model_parallel_group_if_none,
)

_MAX_DATA_DIM = 5
"""Most dimensions a broadcast tensor may have (its shape travels in a fixed-size header)."""


def broadcast_data(keys: list, data: dict, datatype: torch.dtype, tp_group=None) -> dict:
    """``{key: data[key]}`` as held by tensor-parallel rank 0, on every rank of ``tp_group``.

    Only rank 0 needs ``data``; all of ``keys`` must have dtype ``datatype`` there. Collective over
    ``tp_group`` (two broadcasts: the shapes, then the flattened values).
    """
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    device = get_collective_device(tp_group)
    first = dist.get_process_group_ranks(tp_group)[0] if tp_group is not None else 0
    leader = get_pg_rank(tp_group) == 0

    header = torch.zeros(len(keys) * _MAX_DATA_DIM, dtype=torch.long)
    if leader:
        for i, key in enumerate(keys):
            if data[key].dtype != datatype:
                raise TypeError(f"{key} has data type {data[key].dtype}, not {datatype}")
            if data[key].dim() >= _MAX_DATA_DIM:
                raise ValueError(
                    f"{key} has {data[key].dim()} dimensions; at most {_MAX_DATA_DIM - 1} travel"
                )
            header[i * _MAX_DATA_DIM : i * _MAX_DATA_DIM + data[key].dim()] = torch.tensor(data[key].shape)
    header = header.to(device)
    if tp_group is not None:
        dist.broadcast(header, first, group=tp_group)
    shapes = [[int(s) for s in row if s > 0] for row in header.cpu().view(len(keys), _MAX_DATA_DIM)]
    numels = [int(torch.tensor(shape).prod()) if shape else 0 for shape in shapes]

    if leader:
        flat = torch.cat([data[key].to(device).contiguous().view(-1) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    if tp_group is not None:
        dist.broadcast(flat, first, group=tp_group)
    out, offset = {}, 0
    for key, shape, numel in zip(keys, shapes, numels):
        out[key] = flat.narrow(0, offset, numel).view(shape)
        offset += numel
    return out
