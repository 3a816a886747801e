"""Linear and embedding layers whose weights are split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_lite.core.tensor_parallel.utils import (
    VocabUtility,
    divide,
    init_partition_,
    set_tensor_model_parallel_attributes,
)
from megatron_lite.core.transformer.transformer_config import TransformerConfig


def _tp(group) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns: rank r holds A[:, r]. Returns ``(output, output_bias)``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        tp_group=None,
    ):
        super().__init__()
        self.tp_group = tp_group
        rank, world = _tp(tp_group)
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.output_size_per_partition = divide(output_size, world)
        dtype = config.params_dtype
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=dtype))
            init_partition_(self.weight, init_method, 0, rank, world)
            set_tensor_model_parallel_attributes(self.weight, True, 0)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=dtype))
            set_tensor_model_parallel_attributes(self.bias, True, 0)
        else:
            self.bias = None

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None):
        weight = self.weight if weight is None else weight
        input_parallel = copy_to_tensor_model_parallel_region(input_, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        output = F.linear(input_parallel, weight, bias)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows: rank r holds A[r]; partial outputs are all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        tp_group=None,
    ):
        super().__init__()
        self.tp_group = tp_group
        rank, world = _tp(tp_group)
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        dtype = config.params_dtype
        self.weight = nn.Parameter(torch.empty(output_size, divide(input_size, world), dtype=dtype))
        init_partition_(self.weight, init_method, 1, rank, world)
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        # The bias is added after the reduction, so every rank holds the whole (duplicated) bias.
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None

    def forward(self, input_: torch.Tensor):
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        output = reduce_from_tensor_model_parallel_region(F.linear(input_, self.weight), self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank looks up only the ids it owns."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method,
        config: TransformerConfig,
        tp_group=None,
    ):
        super().__init__()
        self.tp_group = tp_group
        rank, world = _tp(tp_group)
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, world
        )
        per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(per_partition, embedding_dim, dtype=config.params_dtype))
        init_partition_(self.weight, init_method, 0, rank, world)
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if _tp(self.tp_group)[1] == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        output = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output, self.tp_group)
