"""The plain collectives the tensor-parallel mappings are made of (mappings.py wraps them in autograd
functions): all-reduce, split, all-gather and reduce-scatter along a dimension, over ``group``.

Each is collective over ``group`` (every rank calls it); a group of None or of size 1 makes it the
identity. Gathers along the first dimension write straight into their output and NCCL reduce-scatters
directly, as megatron-core's; gloo, which has no reduce-scatter, all-reduces and keeps its slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.core.process_group_utils import collective_backend, get_pg_rank, get_pg_size


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    if get_pg_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = get_pg_size(group)
    if size == 1:
        return x
    if x.size(dim) % size:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} does not split into {size} parts")
    return x.chunk(size, dim=dim)[get_pg_rank(group)].contiguous()


# PyTorch's newer name for it (all_gather_into_tensor warns that it is deprecated).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather(x: torch.Tensor, group, dim: int, split_sizes: list[int] | None = None) -> torch.Tensor:
    size = get_pg_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    if split_sizes is None and dim == 0:  # straight into the output, as megatron-core: no parts to cat
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        _all_gather_single(out, x, group=group)
        return out
    if split_sizes is None:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)
    # Uneven parts: each padded to the largest (gloo gathers equal sizes only), then trimmed.
    longest = max(split_sizes)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, longest - x.size(dim)]
    padded = F.pad(x, pad) if longest > x.size(dim) else x
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, split_sizes, strict=True)], dim=dim)


# PyTorch's newer name for it (reduce_scatter_tensor warns that it is deprecated).
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_scatter(x: torch.Tensor, group, dim: int, split_sizes: list[int] | None = None) -> torch.Tensor:
    size = get_pg_size(group)
    if size == 1:
        return x
    # An all-reduce then this rank's slice: the same sums as reduce-scatter, and gloo (CPU) has no
    # reduce_scatter. NCCL takes the direct path.
    if split_sizes is None and collective_backend(group) == "nccl" and dim == 0:
        out = x.new_empty((x.size(0) // size, *x.shape[1:]))
        _reduce_scatter_single(out, x.contiguous(), group=group)
        return out
    total = _reduce(x.clone(), group)
    if split_sizes is None:
        return total.chunk(size, dim=dim)[get_pg_rank(group)].contiguous()
    return torch.split(total, split_sizes, dim=dim)[get_pg_rank(group)].contiguous()
