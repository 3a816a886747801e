"""Tensor parallelism: split layers, region mappings, RNG streams, the vocab-parallel cross entropy."""

from megatron_lite.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.core.tensor_parallel.data import broadcast_data
from megatron_lite.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron_lite.core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_lite.core.tensor_parallel.random import (
    CheckpointFunction,
    CudaRNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    model_parallel_cuda_manual_seed,
)
from megatron_lite.core.tensor_parallel.utils import (
    VocabUtility,
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)

__all__ = [
    "CheckpointFunction",
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabUtility",
    "all_gather_last_dim_from_tensor_parallel_region",
    "broadcast_data",
    "checkpoint",
    "copy_gtp_attributes",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_split_1d_tensor",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "model_parallel_cuda_manual_seed",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "vocab_parallel_cross_entropy",
]
