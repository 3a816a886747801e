"""A module's ``sharded_state_dict`` from its parameters' tensor-parallel attributes (megatron-core's
``make_tp_sharded_tensor_for_checkpoint`` / ``make_sharded_tensor_for_checkpoint``): a parameter
marked ``tensor_model_parallel`` is this rank's chunk along ``partition_dim`` of the full tensor,
any other is whole and replicated over the group. Used for the adapters (and a wrapped base layer
that has no ``sharded_state_dict`` of its own), so a PEFT checkpoint reshards across layouts."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core import parallel_state
from megatron_lite.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron_lite.core.process_group_utils import get_pg_rank, get_pg_size


def _dp_replica(tensor, ep_shared: bool) -> int:
    """This rank's data-parallel copy number of ``tensor`` (0: the copy that is written). An expert
    tensor (``allreduce`` False) is copied over the expert data-parallel group, and one shared by
    every expert-parallel rank over that group too."""
    if not parallel_state.model_parallel_is_initialized():
        return 0
    if getattr(tensor, "allreduce", True):
        return parallel_state.get_data_parallel_rank(with_context_parallel=True)
    edp = parallel_state.get_expert_data_parallel_rank()
    if ep_shared:  # copies: every (expert-parallel rank, expert data-parallel rank) pair
        edp_size = parallel_state.get_expert_data_parallel_world_size()
        return parallel_state.get_expert_model_parallel_rank() * edp_size + edp
    return edp


def module_sharded_state_dict(
    module: nn.Module, prefix: str, sharded_offsets: tuple, tp_group, ep_shared: bool = False
) -> dict:
    """``{prefix + name: ShardedTensor}`` for every entry of ``module.state_dict()``, split over
    ``tp_group`` as its tensor-parallel attributes say; ``sharded_offsets`` (upstream's
    ``(axis, rank, fragments)`` of prepended axes, e.g. stacked layers) are kept in front."""
    tp_rank, tp_size = get_pg_rank(tp_group), get_pg_size(tp_group)
    prepend = len(sharded_offsets)
    out = {}
    for name, tensor in module.state_dict(prefix="", keep_vars=True).items():
        key = prefix + name
        split = getattr(tensor, "tensor_model_parallel", False) and tp_size > 1
        dp = _dp_replica(tensor, ep_shared)
        stride = getattr(tensor, "partition_stride", 1)
        if split and stride > 1:
            out[key] = strided_factory(key, tensor, sharded_offsets, prepend, tp_rank, tp_size, (0, 0, dp))
        elif split:
            axis = prepend + tensor.partition_dim
            out[key] = ShardedTensor.from_rank_offsets(
                key, tensor, *sharded_offsets, (axis, tp_rank, tp_size),
                replica_id=(0, 0, dp), prepend_axis_num=prepend,
            )  # fmt: skip
        else:
            out[key] = ShardedTensor.from_rank_offsets(
                key, tensor, *sharded_offsets, replica_id=(0, tp_rank, dp), prepend_axis_num=prepend
            )
    return out


def strided_factory(
    key: str, tensor, rank_offsets: tuple, prepend: int, tp_rank: int, tp_size: int, replica_id
) -> ShardedTensorFactory:
    """``tensor`` split with ``partition_stride`` s > 1 along its ``partition_dim`` (a gated
    ``linear_fc1``'s ``[gate; up]`` rows) as s pieces, block j at ``j * full / s + rank * block`` of
    the full tensor (megatron-core's ``apply_swiglu_sharded_factory`` for s = 2); ``rank_offsets``
    ``(axis, rank, fragments)`` place the other axes (``prepend`` of them not in ``tensor``)."""
    dim, stride = tensor.partition_dim, tensor.partition_stride

    def build(key, data, replica, _flattened_range=None):
        shape = (1,) * prepend + tuple(data.shape)
        global_shape, global_offset = list(shape), [0] * len(shape)
        for axis, rank, fragments in rank_offsets:
            global_shape[axis], global_offset[axis] = fragments * shape[axis], rank * shape[axis]
        block, axis = data.shape[dim] // stride, prepend + dim
        full = block * stride * tp_size
        pieces = []
        for j, part in enumerate(data.split(block, dim=dim)):
            g_shape, g_offset = list(global_shape), list(global_offset)
            g_shape[axis], g_offset[axis] = full, j * full // stride + tp_rank * block
            pieces.append(
                ShardedTensor(
                    key,
                    part,
                    part.dtype,
                    tuple(part.shape),
                    tuple(g_shape),
                    tuple(g_offset),
                    None,
                    replica,
                    prepend_axis_num=prepend,
                )  # fmt: skip
            )
        return pieces

    return ShardedTensorFactory(key, tensor, build, lambda loaded: torch.cat(loaded, dim=dim), replica_id)
