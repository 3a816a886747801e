"""Causal self-attention with query groups split across tensor-parallel ranks (and the sequence
across CP ranks), optionally rotary-embedded and grouped-query (GQA)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from megatron_lite.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb, packed_rotary_pos_emb
from megatron_lite.core.packed_seq_params import PackedSeqParams, physical_cu_seqlens
from megatron_lite.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.core.tensor_parallel.random import checkpoint
from megatron_lite.core.tensor_parallel.utils import divide
from megatron_lite.core.transformer.dot_product_attention import DotProductAttention
from megatron_lite.core.transformer.transformer_config import TransformerConfig


@dataclass
class SelfAttentionSubmodules:
    """What a layer spec says self-attention is built of (upstream's names). megatron_lite builds
    its own column-parallel QKV, DotProductAttention and row-parallel projection; query / key norms
    are not supported (they must be None or IdentityOp)."""

    linear_qkv: object = None
    core_attention: object = None
    linear_proj: object = None
    q_layernorm: object = None
    k_layernorm: object = None


class SelfAttention(nn.Module):
    """QKV projection (column parallel), causal scaled-dot-product attention, output projection (row
    parallel). Input and output are [s, b, h].

    The QKV output is laid out group-major as upstream: for each of the ``num_query_groups`` key/value
    groups, its ``heads / groups`` query heads, then its key head, then its value head. Splitting that
    by output rows gives each TP rank whole groups, so groups must divide by the TP size.
    """

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
        self.config = config
        tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        groups = config.num_query_groups or config.num_attention_heads
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.groups_per_partition = divide(groups, tp_size)
        self.heads_per_group = divide(config.num_attention_heads, groups)
        self.core_attention = DotProductAttention(config.attention_dropout, cp_group)
        self.cp_group = self.core_attention.cp_group  # None without context parallelism
        # Selective recomputation: keep q, k, v and recompute softmax(q k^T) v in backward.
        self.checkpoint_core_attention = (
            config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
        )
        self.head_dim = config.kv_channels
        query_projection = config.kv_channels * config.num_attention_heads
        kv_projection = config.kv_channels * groups
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            query_projection + 2 * kv_projection,
            config=config,
            init_method=init_method,
            bias=config.add_bias_linear or config.add_qkv_bias,
            tp_group=tp_group,
        )
        self.linear_proj = RowParallelLinear(
            query_projection,
            config.hidden_size,
            config=config,
            init_method=output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=tp_group,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """With ``packed_seq_params`` the row holds several examples: each attends to itself only and
        is rotated by its own positions (``rotary_pos_emb`` then holds angles by position within an
        example, as upstream's thd format: ``RotaryEmbedding(..., packed_seq=True)``)."""
        mixed, _ = self.linear_qkv(hidden_states)
        s, b = mixed.shape[:2]  # the whole (CP-local) sequence, also when the input was sequence-parallel
        # [s, b, groups, heads_per_group + 2, d] -> q [s, b, heads, d], k and v [s, b, groups, d]
        mixed = mixed.view(s, b, self.groups_per_partition, self.heads_per_group + 2, self.head_dim)
        q, k, v = mixed.split([self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.heads_per_partition, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)
        if rotary_pos_emb is not None:
            if packed_seq_params is not None:  # once for q and k (upstream passes cu_seqlens to each)
                cu = physical_cu_seqlens(packed_seq_params)
                rotary_pos_emb = packed_rotary_pos_emb(rotary_pos_emb, cu, s, self.cp_group)
            q = apply_rotary_pos_emb(q, rotary_pos_emb, self.config)
            k = apply_rotary_pos_emb(k, rotary_pos_emb, self.config)
        if rotary_pos_emb is not None or self.heads_per_group > 1:
            # q is a copy (rotated, or regrouped by the reshape): k and v become copies too, so the
            # QKV output is freed rather than kept for their views, as TE's attention does
            # (megatron-core's TEDotProductAttention makes all three contiguous then).
            k, v = k.contiguous(), v.contiguous()
        # -> [b, heads, s, d] for the attention kernel
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        # The boundaries go in by closure: the checkpoint saves tensors only, and recomputes with them.
        core_attention = functools.partial(self.core_attention, packed_seq_params=packed_seq_params)
        if self.checkpoint_core_attention and self.training:
            context = checkpoint(core_attention, False, q, k, v)
        else:
            context = core_attention(q, k, v)
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_partition * self.head_dim)
        output, _ = self.linear_proj(context)
        return output
