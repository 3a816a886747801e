"""Predicted weight-and-optimizer memory, from the model's shape (an estimate, printed as one).

Counts the parameters each rank of a pipeline stage holds, for any architecture the model builds:
grouped-query QKV, gated MLPs, LayerNorm or RMSNorm, biases or none, learned positions or rotary,
tied or untied output layer, the padded vocabulary. Column-parallel weights (and their biases) and
row-parallel weights are split over tensor-parallel ranks; norms and row-parallel biases are whole.
"""

from __future__ import annotations

from megatron_lite.core.transformer.pipeline_layer_split import layers_per_pipeline_stage


def _layer_parameters_per_rank(m) -> float:
    h, ffn, tp = m.hidden_size, m.ffn_hidden_size or 4 * m.hidden_size, m.tensor_model_parallel_size
    query = m.kv_channels * m.num_attention_heads
    qkv = query + 2 * m.kv_channels * (m.num_query_groups or m.num_attention_heads)
    fc1 = ffn * (2 if m.gated_linear_unit else 1)
    bias, qkv_bias = m.add_bias_linear, m.add_bias_linear or m.add_qkv_bias
    split = h * qkv + qkv * qkv_bias + query * h + h * fc1 + fc1 * bias + ffn * h
    norm = 2 * h if m.normalization == "LayerNorm" else h
    whole = 2 * norm + 2 * h * bias  # two norms; the output projection's and fc2's biases
    return split / tp + whole


def num_parameters_per_rank(m, pp_rank: int) -> float:
    """Parameters one tensor-parallel rank of pipeline stage ``pp_rank`` holds (``m`` a GPTModelProvider)."""
    pp, tp, h = m.pipeline_model_parallel_size, m.tensor_model_parallel_size, m.hidden_size
    vocab = m.padded_vocab_size if hasattr(m, "padded_vocab_size") else m.vocab_size
    first, last = pp_rank == 0, pp_rank == pp - 1
    params = layers_per_pipeline_stage(m)[pp_rank] * _layer_parameters_per_rank(m)
    if first:
        params += vocab * h / tp
        if getattr(m, "position_embedding_type", "learned_absolute") == "learned_absolute":
            params += (m.max_position_embeddings or m.seq_length) * h
    if last:
        params += h * (2 if m.normalization == "LayerNorm" else 1)  # the final norm
        if not (first and m.share_embeddings_and_output_weights):
            params += vocab * h / tp  # its own output layer (a copy of the embedding when tied)
    return params


def report_theoretical_memory(config, num_microbatches: int | None = None, verbose: bool = False) -> float:
    """Print (on the calling rank) and return the weight-and-optimizer memory, in MB, that a rank of
    the most loaded pipeline stage needs: 16 bytes per parameter (fp32 weight, fp32 gradient, two fp32
    Adam moments), 18 with bf16 (plus the bf16 compute copy). The distributed optimizer divides the
    optimizer's share by the data-parallel size: 8 + 8 / dp, or upstream's 6 + 12 / dp with bf16. An
    estimate, not a measurement; activation memory is not estimated here."""
    m = config.model
    params = max(num_parameters_per_rank(m, rank) for rank in range(m.pipeline_model_parallel_size))
    bf16 = getattr(m, "bf16", False)
    bytes_per_param = 18 if bf16 else 16
    if config.optimizer.use_distributed_optimizer:
        dp = config.data_parallel_size * m.context_parallel_size  # sharded over dp x cp
        bytes_per_param = 6 + 12 / dp if bf16 else 8 + 8 / dp
    megabytes = params * bytes_per_param / (1024 * 1024)
    if verbose:
        print(
            f"Theoretical memory footprints: weight and optimizer={megabytes:.2f} MB"
            f" (estimate for {params:.0f} parameters per rank)",
            flush=True,
        )
    return megabytes
