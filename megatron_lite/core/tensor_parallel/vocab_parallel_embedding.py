"""The vocabulary-parallel embedding of megatron.core.tensor_parallel.layers (importable there)."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core.model_parallel_config import ModelParallelConfig
from megatron_lite.core.process_group_utils import (
    get_pg_rank,
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)
from megatron_lite.core.tensor_parallel.embedding_grad import embedding
from megatron_lite.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_lite.core.tensor_parallel.utils import VocabUtility, new_partitioned_parameter


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank looks up only the ids it owns and the
    partial embeddings are all-reduced over ``tp_group`` (collective)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method,
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group=None,
        pg_collection=None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.config = num_embeddings, embedding_dim, config
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.tp
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        rank, world = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, world
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        shape = (self.num_embeddings_per_partition, embedding_dim)
        self.weight = new_partitioned_parameter(shape, config, init_method, 0, rank, world)
        # Set by a model that also uses the weight elsewhere on this rank (a tied output layer).
        self.weight_used_elsewhere = False

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        def lookup(ids):
            return embedding(ids, self.weight, weight_used_elsewhere=self.weight_used_elsewhere)

        if get_pg_size(self.tp_group) == 1:
            output = lookup(input_)
        else:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
            output = lookup(local_ids).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            # [b, s, h] -> [s, b, h], then each rank keeps its share of the sequence.
            return reduce_scatter_to_sequence_parallel_region(
                output.transpose(0, 1).contiguous(), self.tp_group
            )
        if get_pg_size(self.tp_group) == 1:
            return output
        return reduce_from_tensor_model_parallel_region(output, self.tp_group)
