"""Word plus learned absolute position embeddings, output [s, b, h]."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core.tensor_parallel import VocabParallelEmbedding
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.utils import init_method_normal


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int, tp_group=None):
        super().__init__()
        init = init_method_normal(config.init_method_std)
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=init, config=config, tp_group=tp_group
        )
        # Position embeddings are small and live whole on the first stage (not split across TP).
        self.position_embeddings = nn.Embedding(
            max_sequence_length, config.hidden_size, dtype=config.params_dtype
        )
        with torch.no_grad():
            weight = torch.empty(max_sequence_length, config.hidden_size)
            init(weight)
            self.position_embeddings.weight.copy_(weight)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return embeddings.transpose(0, 1).contiguous()
