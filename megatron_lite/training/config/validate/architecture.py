"""Checks of the model's architecture options (positions, norm, MLP, attention groups, vocabulary),
run by validate with the other config checks: each failure is one ConfigError naming the flag."""

from __future__ import annotations

from megatron_lite.core.transformer.torch_norm import NORMALIZATIONS
from megatron_lite.training.errors import ConfigError

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


def check_architecture(cfg) -> None:
    m = cfg.model
    tp = m.tensor_model_parallel_size
    position_type = getattr(m, "position_embedding_type", "learned_absolute")
    if position_type in ("mrope", "relative"):
        raise ConfigError(
            "--position-embedding-type", f"{position_type!r} is not supported yet by megatron_lite"
        )
    if position_type not in POSITION_EMBEDDING_TYPES:
        raise ConfigError(
            "--position-embedding-type",
            f"must be one of {', '.join(POSITION_EMBEDDING_TYPES)}, got {position_type!r}",
        )
    if m.normalization not in NORMALIZATIONS:
        raise ConfigError("--normalization", f"must be LayerNorm or RMSNorm, got {m.normalization!r}")
    if m.layernorm_epsilon <= 0:
        raise ConfigError("--norm-epsilon", f"must be positive, got {m.layernorm_epsilon}")
    if m.kv_channels is None or m.kv_channels <= 0:
        raise ConfigError("--kv-channels", f"must be a positive integer, got {m.kv_channels}")
    if position_type == "rope":
        _check_rotary(m)
    elif getattr(m, "rope_scaling", False):
        raise ConfigError(
            "--use-rope-scaling",
            f"scales rotary frequencies: it needs --position-embedding-type rope, not {position_type!r}",
        )
    groups = m.num_query_groups or m.num_attention_heads
    if groups <= 0:
        raise ConfigError("--num-query-groups", f"must be a positive integer, got {groups}")
    if m.num_attention_heads % groups:
        raise ConfigError(
            "--num-query-groups",
            f"{groups} groups do not divide --num-attention-heads {m.num_attention_heads}; "
            "each group must serve the same number of query heads",
        )
    if groups % tp:
        raise ConfigError(
            "--num-query-groups",
            f"{groups} groups do not split over --tensor-model-parallel-size {tp}; "
            f"use a multiple of {tp} (each TP rank holds whole key/value groups)",
        )
    if m.gated_linear_unit and (m.ffn_hidden_size is None or m.ffn_hidden_size <= 0):
        raise ConfigError(
            "--ffn-hidden-size",
            f"--swiglu's default (4 h 2/3 rounded down to 64) is {m.ffn_hidden_size} for --hidden-size "
            f"{m.hidden_size}; set --ffn-hidden-size",
        )
    if getattr(m, "make_vocab_size_divisible_by", 1) <= 0:
        raise ConfigError("--make-vocab-size-divisible-by", "must be a positive integer")


def _check_rotary(m) -> None:
    percent = m.rotary_percent
    if not 0.0 < percent <= 1.0:
        raise ConfigError("--rotary-percent", f"must be in (0, 1], got {percent}")
    rotated = int(m.kv_channels * percent)
    if rotated < 2 or rotated % 2:
        raise ConfigError(
            "--rotary-percent",
            f"rotates {rotated} of --kv-channels {m.kv_channels} channels per head; "
            "that must be a positive even number",
        )
    if m.rotary_base <= 0:
        raise ConfigError("--rotary-base", f"must be positive, got {m.rotary_base}")
    factor = m.seq_len_interpolation_factor
    if factor is not None and factor <= 0:
        raise ConfigError("--rotary-seq-len-interpolation-factor", f"must be positive, got {factor}")
