"""A pre-norm transformer layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.transformer.attention import SelfAttention
from megatron_lite.core.transformer.mlp import MLP
from megatron_lite.core.transformer.torch_norm import WrappedTorchNorm
from megatron_lite.core.transformer.transformer_config import TransformerConfig


class TransformerLayer(nn.Module):
    """x + dropout(attn(norm(x))), then x + dropout(mlp(norm(x))). ``layer_number`` is global (1-based)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        *,
        init_method,
        output_layer_init_method,
        tp_group=None,
        cp_group=None,
    ):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = WrappedTorchNorm(config, config.hidden_size)
        self.self_attention = SelfAttention(
            config,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            tp_group=tp_group,
            cp_group=cp_group,
        )
        self.pre_mlp_layernorm = WrappedTorchNorm(config, config.hidden_size)
        self.mlp = MLP(
            config,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            tp_group=tp_group,
        )

    def forward(
        self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Hidden dropout acts on activations every TP rank holds whole: the default stream, alike on all.
        p = self.hidden_dropout if self.training else 0.0
        attention = self.self_attention(self.input_layernorm(hidden_states), rotary_pos_emb)
        hidden_states = hidden_states + F.dropout(attention, p=p, training=self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return hidden_states + F.dropout(mlp, p=p, training=self.training)
