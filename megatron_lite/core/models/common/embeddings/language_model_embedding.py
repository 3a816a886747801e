"""Word embeddings, plus learned absolute position embeddings when the model uses them; output [s, b, h]."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core.tensor_parallel import VocabParallelEmbedding
from megatron_lite.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.utils import init_method_normal


class LanguageModelEmbedding(nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
        tp_group=None,
        pg_collection=None,
    ):
        """Upstream's signature. ``rope`` and ``none`` add no position table here (rotary embeddings
        act inside attention); no token types; ``scatter_to_sequence_parallel`` has no effect without
        sequence parallelism."""
        super().__init__()
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise NotImplementedError(
                f"position_embedding_type={position_embedding_type!r} is not supported by megatron_lite"
            )
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        if num_tokentypes:
            raise NotImplementedError("token-type embeddings are not supported by megatron_lite")
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.tp
        self.config, self.vocab_size, self.max_sequence_length = config, vocab_size, max_sequence_length
        self.tp_group = tp_group
        init = init_method_normal(config.init_method_std)
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=init, config=config, tp_group=tp_group
        )
        if self.add_position_embedding:
            # Position embeddings are small and live whole on the first stage (not split across TP).
            self.position_embeddings = nn.Embedding(
                max_sequence_length, config.hidden_size, dtype=config.params_dtype
            )
            with torch.no_grad():
                weight = torch.empty(max_sequence_length, config.hidden_size)
                init(weight)
                self.position_embeddings.weight.copy_(weight)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids=None
    ) -> torch.Tensor:
        if tokentype_ids is not None:
            raise NotImplementedError("token-type embeddings are not supported by megatron_lite")
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            # Each TP rank keeps its share of the sequence; the gradient is gathered back.
            embeddings = scatter_to_sequence_parallel_region(embeddings, group=self.tp_group)
        return embeddings
