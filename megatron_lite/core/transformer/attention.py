"""Causal self-attention with heads split across tensor-parallel ranks (and sequence across CP ranks)."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.core.tensor_parallel.utils import divide
from megatron_lite.core.transformer.dot_product_attention import DotProductAttention
from megatron_lite.core.transformer.transformer_config import TransformerConfig


class SelfAttention(nn.Module):
    """QKV projection (column parallel, head-major layout so each rank owns whole heads), causal
    scaled-dot-product attention, output projection (row parallel). Input and output are [s, b, h]."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        init_method,
        output_layer_init_method,
        tp_group=None,
        cp_group=None,
    ):
        super().__init__()
        tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.core_attention = DotProductAttention(config.attention_dropout, cp_group)
        self.head_dim = config.kv_channels
        projection = config.kv_channels * config.num_attention_heads
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            3 * projection,
            config=config,
            init_method=init_method,
            bias=config.add_bias_linear,
            tp_group=tp_group,
        )
        self.linear_proj = RowParallelLinear(
            projection,
            config.hidden_size,
            config=config,
            init_method=output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        s, b, _ = hidden_states.shape
        mixed, _ = self.linear_qkv(hidden_states)
        # [s, b, heads, 3, d] -> three [b, heads, s, d]
        q, k, v = (
            mixed.view(s, b, self.heads_per_partition, 3, self.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        )
        context = self.core_attention(q, k, v)
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_partition * self.head_dim)
        output, _ = self.linear_proj(context)
        return output
