"""Contiguous gradient (and, for the distributed optimizer, parameter) buffers split into buckets.

Parameters are laid out in reverse order (roughly the order backward produces their gradients) and
grouped into buckets of at least ``bucket_size`` elements. With the distributed optimizer each bucket
is padded at its end to a multiple of the data-parallel size, so every rank owns one contiguous,
equal shard of it (``shard``); the gradient is reduce-scattered into that shard and the parameters
all-gathered back from it. Without it a bucket is all-reduced. Communication may be asynchronous:
``start_*`` returns at once and ``finish_*`` waits on the gloo/NCCL work handle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# torch >= 2.10 renamed the tensor collectives; fall back for older versions.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _ParamAndGradBucket:
    """One bucket: views into its buffer's grad (and param) data, and its pending work handles."""

    def __init__(
        self, params, grad_data, param_data, offset, numel_unpadded, dp_group, use_dist_opt, scaling
    ):
        self.params = params
        self.grad_data = grad_data
        self.param_data = param_data
        self.offset = offset  # start in the buffer
        self.numel_unpadded = numel_unpadded
        self.dp_group = dp_group
        self.dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.dp_rank = 0 if dp_group is None else dist.get_rank(dp_group)
        self.use_dist_opt = use_dist_opt
        self.gradient_scaling_factor = 1.0 / self.dp_size if scaling is None else scaling
        self.grad_handle = None
        self.param_handle = None
        self.ready: set[nn.Parameter] = set()
        self.grad_sync_started = False

    def shard(self, data: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """This (or ``rank``'s) contiguous 1/dp of ``data``, a view."""
        size = data.numel() // self.dp_size
        rank = self.dp_rank if rank is None else rank
        return data[rank * size : (rank + 1) * size]

    def start_grad_sync(self, async_op: bool, force_all_reduce: bool = False) -> None:
        """Average the bucket's gradients over dp: reduce-scatter into this rank's shard (distributed
        optimizer, unless ``force_all_reduce``) or all-reduce. Collective over the dp group."""
        self.grad_sync_started = True
        if self.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(self.gradient_scaling_factor)
        if self.dp_size == 1:
            return
        if self.use_dist_opt and not force_all_reduce:
            self.grad_handle = _reduce_scatter(
                self.shard(self.grad_data), self.grad_data, group=self.dp_group, async_op=async_op
            )
        else:
            self.grad_handle = dist.all_reduce(self.grad_data, group=self.dp_group, async_op=async_op)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        if not self.grad_sync_started:
            self.start_grad_sync(async_op=False, force_all_reduce=force_all_reduce)
        if self.grad_handle is not None:
            self.grad_handle.wait()
            self.grad_handle = None

    def start_param_sync(self, async_op: bool) -> None:
        """All-gather every rank's updated parameter shard. Collective over the dp group."""
        if self.dp_size > 1:
            self.param_handle = _all_gather(
                self.param_data, self.shard(self.param_data), group=self.dp_group, async_op=async_op
            )

    def finish_param_sync(self) -> None:
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None

    def reset(self) -> None:
        self.ready.clear()
        self.grad_sync_started = False


class _ParamAndGradBuffer:
    """All parameters of one dtype of a model chunk: the buffers, the buckets, and each parameter's
    place (``param_index_map[p] = (start, end, bucket_index)`` in the buffer)."""

    def __init__(
        self,
        params,
        *,
        dp_group,
        bucket_size: int | None,
        use_distributed_optimizer: bool,
        gradient_scaling_factor: float | None = None,
    ):
        """``gradient_scaling_factor``: what the gradients are multiplied by before the reduction
        (None: 1 / the size of ``dp_group``, the mean)."""
        dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.param_index_map: dict[nn.Parameter, tuple[int, int, int]] = {}
        self.param_unpadded_start: dict[nn.Parameter, int] = {}  # offset with bucket padding removed
        layout: list[tuple[list[nn.Parameter], int, int, int]] = []  # params, start, unpadded, padded
        current: list[nn.Parameter] = []
        start = offset = unpadded = 0

        def close():
            nonlocal start, offset, current
            numel = offset - start
            if use_distributed_optimizer:  # equal shards for every dp rank
                offset = start + -(-numel // dp_size) * dp_size
            layout.append((current, start, numel, offset - start))
            current, start = [], offset

        for p in reversed(params):
            # As upstream: with reduce-scatter, a tied embedding gets its own bucket so the first and
            # last stage shard it identically (their embedding all-reduce follows the reduce-scatter).
            own_bucket = use_distributed_optimizer and getattr(p, "shared_embedding", False)
            if own_bucket and current:
                close()
            self.param_index_map[p] = (offset, offset + p.numel(), len(layout))
            self.param_unpadded_start[p] = unpadded
            current.append(p)
            offset += p.numel()
            unpadded += p.numel()
            if own_bucket or (bucket_size is not None and offset - start >= bucket_size):
                close()
        if current:
            close()
        device = params[0].device
        self.numel = offset
        self.grad_data = torch.zeros(offset, dtype=torch.float32, device=device)
        self.param_data = None
        if use_distributed_optimizer:
            # Parameters become views into one buffer, so the all-gather writes them in place.
            self.param_data = torch.zeros(offset, dtype=params[0].dtype, device=device)
        for p, (begin, end, _) in self.param_index_map.items():
            p.main_grad = self.grad_data[begin:end].view_as(p)
            if self.param_data is not None:
                self.param_data[begin:end].copy_(p.data.view(-1))
                p.data = self.param_data[begin:end].view_as(p)
        self.buckets = [
            _ParamAndGradBucket(
                bucket_params,
                self.grad_data[begin : begin + padded],
                None if self.param_data is None else self.param_data[begin : begin + padded],
                begin,
                numel,
                dp_group,
                use_distributed_optimizer,
                gradient_scaling_factor,
            )
            for bucket_params, begin, numel, padded in layout
        ]

    def register_grad_ready(self, param: nn.Parameter, async_op: bool) -> None:
        """Mark ``param``'s gradient final; the bucket's reduction starts once all of it is final."""
        bucket = self.buckets[self.param_index_map[param][2]]
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params) and not bucket.grad_sync_started:
            bucket.start_grad_sync(async_op=async_op)
