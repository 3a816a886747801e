"""Model FLOPs of one training step (forward and backward), for the logged TFLOP/s."""

from __future__ import annotations

from megatron_lite.core.transformer.moe.moe_layer import moe_layer_pattern


def num_floating_point_operations(cfg, batch_size: int = 1) -> float:
    """FLOPs of forward + backward over ``batch_size`` sequences for our dense GPT, as upstream counts.

    Matrix multiplies count 2 FLOPs per multiply-add; backward costs twice the forward. Per token and
    layer: the QKV projection (h x (q + 2 kv), with q = kv_channels x heads and kv = kv_channels x
    query groups, so GQA's smaller K/V counts less), the output projection (q x h), the MLP (h x ffn
    in, twice for a gated MLP's gate and value, ffn x h out) and attention scores and values (2 s q,
    causal masking not subtracted, as Megatron counts it); plus the output layer (h V). A MoE layer's
    MLP counts its top-k experts and its shared expert. ``cfg`` is a ConfigContainer.
    """
    m = cfg.model
    h, layers, ffn = m.hidden_size, m.num_layers, m.ffn_hidden_size or 4 * m.hidden_size
    seq = m.seq_length  # validate keeps a GPT dataset's equal to it; a custom provider may have none
    vocab = m.padded_vocab_size if hasattr(m, "padded_vocab_size") else m.vocab_size
    query = m.kv_channels * m.num_attention_heads
    key_value = m.kv_channels * (getattr(m, "num_query_groups", None) or m.num_attention_heads)
    gated = 2 if getattr(m, "gated_linear_unit", False) else 1
    attention = h * (query + 2 * key_value) + query * h + 2 * seq * query
    # A MoE layer's MLP work per token: its top-k experts' and the shared expert's (the router's
    # h x experts is left out, as upstream leaves it).
    moe_layers = sum(moe_layer_pattern(m)) if getattr(m, "num_moe_experts", None) else 0
    moe_ffn = (
        (m.moe_ffn_hidden_size * m.moe_router_topk + (m.moe_shared_expert_intermediate_size or 0))
        if moe_layers
        else 0
    )
    mlp = (layers - moe_layers) * (gated + 1) * h * ffn + moe_layers * (gated + 1) * h * moe_ffn
    per_token_forward = 2 * (layers * attention + mlp + h * vocab)
    return 3.0 * per_token_forward * seq * batch_size
