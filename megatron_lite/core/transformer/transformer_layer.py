"""A pre-LayerNorm transformer layer."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core.transformer.attention import SelfAttention
from megatron_lite.core.transformer.mlp import MLP
from megatron_lite.core.transformer.transformer_config import TransformerConfig


class TransformerLayer(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)). ``layer_number`` is global (1-based) across stages."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        *,
        init_method,
        output_layer_init_method,
        tp_group=None,
    ):
        super().__init__()
        self.layer_number = layer_number
        eps, h, dtype = config.layernorm_epsilon, config.hidden_size, config.params_dtype
        self.input_layernorm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.self_attention = SelfAttention(
            config,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            tp_group=tp_group,
        )
        self.pre_mlp_layernorm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.mlp = MLP(
            config,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.pre_mlp_layernorm(hidden_states))
