"""Small helpers shared by the tensor-parallel layers."""

from __future__ import annotations

import torch


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


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
    param: torch.Tensor, init_method, partition_dim: int | None, rank: int, world_size: int
) -> None:
    """Fill ``param`` with this rank's slice of a full-size master weight drawn by ``init_method``.

    Drawing the full weight on every rank (from the same RNG state) makes the initial model identical
    whatever the tensor-parallel size, which is what makes loss parity across layouts possible.
    """
    full_shape = list(param.shape)
    if partition_dim is not None:
        full_shape[partition_dim] *= world_size
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    if partition_dim is not None:
        master = master.chunk(world_size, dim=partition_dim)[rank]
    with torch.no_grad():
        param.copy_(master)


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1
) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for parameters that count once across tensor-parallel ranks (for norms)."""
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0
