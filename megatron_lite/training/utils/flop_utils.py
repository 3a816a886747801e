"""Model FLOPs of one training step (forward and backward), for the logged TFLOP/s."""

from __future__ import annotations


def num_floating_point_operations(cfg, batch_size: int = 1) -> float:
    """FLOPs of forward + backward over ``batch_size`` sequences for our dense GPT.

    Matrix multiplies count 2 FLOPs per multiply-add; backward costs twice the forward. Per token and
    layer: the QKV and output projections (4 h^2, as kv_channels * heads == hidden size), the MLP
    (2 h ffn) and attention scores and values (2 s h, causal masking not subtracted, as Megatron
    counts it); plus the output layer (h V). ``cfg`` is a ConfigContainer.
    """
    m = cfg.model
    h, layers, ffn = m.hidden_size, m.num_layers, m.ffn_hidden_size or 4 * m.hidden_size
    seq = cfg.dataset.seq_length if hasattr(cfg.dataset, "seq_length") else cfg.dataset.sequence_length
    vocab = m.padded_vocab_size if hasattr(m, "padded_vocab_size") else m.vocab_size
    attn_proj = 4 * h * m.kv_channels * m.num_attention_heads
    per_token_forward = 2 * (layers * (attn_proj + 2 * h * ffn + 2 * seq * h) + h * vocab)
    return 3.0 * per_token_forward * seq * batch_size
