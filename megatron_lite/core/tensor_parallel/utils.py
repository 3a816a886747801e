"""Small helpers shared by the tensor-parallel layers, as megatron.core.tensor_parallel.utils."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.process_group_utils import (
    get_pg_rank,
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """``num_partitions`` equal views of ``tensor`` along its last dimension (copies when
    ``contiguous_split_chunks``)."""
    chunk = divide(tensor.size(-1), num_partitions)
    parts = torch.split(tensor, chunk, dim=-1)
    return tuple(p.contiguous() for p in parts) if contiguous_split_chunks else parts


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False, tp_group=None):
    """This tensor-parallel rank's equal share of ``tensor`` flattened: a view, or a copy when
    ``new_buffer``."""
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    size = divide(tensor.numel(), get_pg_size(tp_group))
    start = size * get_pg_rank(tp_group)
    data = tensor.view(-1)[start : start + size]
    return data.clone() if new_buffer else data


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Inverse of ``split_tensor_into_1d_equal_chunks``: every rank's share, concatenated (flat).
    Collective over ``tp_group``."""
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    world = get_pg_size(tp_group)
    if world == 1:
        return tensor.reshape(-1).clone()
    parts = [torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device) for _ in range(world)]
    dist.all_gather(parts, tensor.reshape(-1).contiguous(), group=tp_group)
    return torch.cat(parts)


class VocabUtility:
    """The vocabulary range [first, last) owned by one tensor-parallel rank."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int, world_size: int):
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int):
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


def init_partition_(
    param: torch.Tensor,
    init_method,
    partition_dim: int | None,
    rank: int,
    world_size: int,
    stride: int = 1,
) -> None:
    """Fill ``param`` with this rank's slice of a full-size master weight drawn by ``init_method``.

    Drawing the full weight on every rank (from the same RNG state) makes the initial model identical
    whatever the tensor-parallel size, which is what makes loss parity across layouts possible. With
    ``stride`` > 1 the master is cut into ``stride * world_size`` blocks and rank r keeps blocks
    r, r + world_size, ... (upstream's layout for fused projections).
    """
    full_shape = list(param.shape)
    if partition_dim is not None:
        full_shape[partition_dim] *= world_size
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    if partition_dim is not None:
        if stride == 1:
            master = master.chunk(world_size, dim=partition_dim)[rank]
        else:
            block = divide(param.shape[partition_dim], stride)
            master = torch.cat(
                torch.split(master, block, dim=partition_dim)[rank::world_size], dim=partition_dim
            )
    with torch.no_grad():
        param.copy_(master)


# Tensor-parallel attributes on parameters (re-exported by layers.py, their upstream home) -----------

# Upstream's set: the split itself, plus the expert and fused-QKV marks a parameter's views and master
# copies must keep.
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "expert_tp": False,
    "is_qkv": False,
    "qkv_split_shapes": None,
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}
_GTP_ATTRIBUTES = ("is_gtp_weight_remat", "allreduce", "gtp_replica_group", "pad_length")


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1):
    """Mark ``tensor`` as split (or not) along ``dim``; setting them twice is a bug, so it asserts."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        assert not hasattr(tensor, attribute), f"tensor already has {attribute}"
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the "not split" attributes where it has none."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copy the tensor-parallel attributes ``source_tensor`` has onto ``destination_tensor``."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def copy_gtp_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy upstream's GTP-remat metadata (kept by optimizer copies) where ``source`` has it."""
    for attribute in _GTP_ATTRIBUTES:
        if hasattr(source, attribute):
            setattr(destination, attribute, getattr(source, attribute))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_group=None, expert_tp_group=None) -> bool:
    """True for parameters that count once across tensor-parallel ranks (norms, counts): split ones
    everywhere, duplicated ones on tensor-parallel rank 0 only.

    ``tp_group`` is a process group (or anything with ``rank()``); an int is taken as the rank itself
    (megatron_lite's optimizer passes its cached rank). None falls back to parallel_state. Parameters
    marked ``allreduce=False`` (expert topology) use ``expert_tp_group`` where given.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    if not getattr(param, "allreduce", True) and expert_tp_group is not None:
        tp_group = expert_tp_group
    if isinstance(tp_group, int):
        return tp_group == 0
    if tp_group is not None:
        return tp_group.rank() == 0
    from megatron_lite.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0


def parameter_device(config) -> torch.device:
    """Where a layer allocates its parameters: the CPU under ``use_cpu_initialization`` or without CUDA."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def new_partitioned_parameter(shape, config, init_method, partition_dim, rank, world, stride=1):
    """A tensor-parallel parameter of this rank's ``shape``, initialised from the full master weight
    (or left empty when ``config.perform_initialization`` is off)."""
    weight = torch.nn.Parameter(
        torch.empty(*shape, dtype=config.params_dtype, device=parameter_device(config))
    )
    if config.perform_initialization:
        init_partition_(weight, init_method, partition_dim, rank, world, stride)
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    weight.allreduce = True  # reduced over the dense data-parallel group (not the expert one)
    return weight
