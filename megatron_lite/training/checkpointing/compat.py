"""Whether a checkpoint's weights fit this run's model: the same architecture, and each stage's
shard holding the same layers. Each mismatch is one line naming the flag to change."""

from __future__ import annotations

import types

from megatron_lite.core.transformer.pipeline_layer_split import pipeline_layer_counts

# Model fields that make a checkpoint's weights another architecture: (field, flag, default of a
# checkpoint saved before the field existed).
_ARCHITECTURE = (
    ("num_layers", "--num-layers", None),
    ("hidden_size", "--hidden-size", None),
    ("num_attention_heads", "--num-attention-heads", None),
    ("num_query_groups", "--num-query-groups", None),
    ("kv_channels", "--kv-channels", None),
    ("ffn_hidden_size", "--ffn-hidden-size", None),
    ("normalization", "--normalization", "LayerNorm"),
    ("gated_linear_unit", "--swiglu", False),
    ("activation_func", "activation", "gelu"),
    ("position_embedding_type", "--position-embedding-type", "learned_absolute"),
    ("rotary_percent", "--rotary-percent", 1.0),
    ("rotary_base", "--rotary-base", 10000),
    ("rotary_interleaved", "--rotary-interleaved", False),
    ("seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor", None),
    ("rope_scaling", "--use-rope-scaling", False),
    ("rope_scaling_factor", "--rope-scaling-factor", 8.0),
    ("add_bias_linear", "--disable-bias-linear", True),
    ("add_qkv_bias", "--add-qkv-bias", False),
    ("share_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", True),
    ("num_moe_experts", "--num-experts", None),
    ("moe_layer_freq", "--moe-layer-freq", 1),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size", None),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", None),
    ("moe_shared_expert_gate", "--moe-shared-expert-gate", False),
    ("padded_vocab_size", "--vocab-size / --make-vocab-size-divisible-by", None),
)


def _architecture_value(model, name: str, default=None):
    value = model.get(name, default) if isinstance(model, dict) else getattr(model, name, default)
    if name == "num_query_groups" and value is None:
        value = _architecture_value(model, "num_attention_heads")  # None means one group per head
    if name == "rope_scaling_factor" and not _architecture_value(model, "rope_scaling", False):
        return None  # unscaled frequencies do not depend on the factor
    if name == "padded_vocab_size" and isinstance(model, dict):
        multiple = model.get("make_vocab_size_divisible_by", 128) * model.get("tensor_model_parallel_size", 1)
        value = -(-model.get("vocab_size", 0) // multiple) * multiple
    return getattr(value, "__name__", value) if callable(value) else value


# A weights-only load reshards the vocabulary for this run's tp: its padding may differ, its words not.
_RESHARDED_ARCHITECTURE = tuple(f for f in _ARCHITECTURE if f[0] != "padded_vocab_size") + (
    ("vocab_size", "--vocab-size", None),
    ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by", 128),
)


def _architecture_error(root: str, saved_config: dict, model, fields=_ARCHITECTURE) -> str | None:
    """One line naming the first architecture field where the checkpoint and this run differ."""
    saved = (saved_config or {}).get("model", {})
    if not saved:
        return None  # a checkpoint without a stored config: the weights' shapes are checked on load
    for name, flag, default in fields:
        before, now = _architecture_value(saved, name, default), _architecture_value(model, name, default)
        if before != now:
            return (
                f"--load {root}: the checkpoint's model has {name}={before!r} but {flag} gives "
                f"{name}={now!r}; use the saved architecture's flags"
            )
    return None


_SPLIT_FIELDS = {
    "num_layers": 0,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    "pipeline_model_parallel_layout": None,
}


def saved_split(saved_config: dict) -> types.SimpleNamespace | None:
    """The saving run's layer-split fields, what ``pipeline_layer_counts`` reads; None without a
    stored config."""
    saved = (saved_config or {}).get("model", {})
    if not saved:
        return None
    return types.SimpleNamespace(**{k: saved.get(k, default) for k, default in _SPLIT_FIELDS.items()})


def _split_error(root: str, saved_config: dict, model) -> str | None:
    """One line when the checkpoint's layers sit on other stages or chunks than this run's: the shards
    hold each stage's own layers, so another split would load the wrong layers' weights."""
    before = saved_split(saved_config)
    if before is None:
        return None
    if (before.virtual_pipeline_model_parallel_size or 1) != (
        model.virtual_pipeline_model_parallel_size or 1
    ):
        return None  # another number of model chunks: the load names the chunks it misses
    try:
        saved_counts = pipeline_layer_counts(before)
    except ValueError:
        return None  # not a split megatron_lite writes: the weights' shapes are checked on load
    counts = pipeline_layer_counts(model)
    if saved_counts == counts:
        return None
    return (
        f"--load {root}: the checkpoint's model chunks hold {saved_counts} layers (per chunk, per stage) "
        f"but this run's hold {counts}; use the saved --decoder-first-pipeline-num-layers, "
        "--decoder-last-pipeline-num-layers, --account-for-*-in-pipeline-split or "
        "--pipeline-model-parallel-layout flags (--finetune or --pretrained-checkpoint load the weights "
        "at any split)"
    )


def checkpoint_model_error(root: str, saved_config: dict, model) -> str | None:
    """The first architecture or layer-split difference between the checkpoint and this run, or None."""
    return _architecture_error(root, saved_config, model) or _split_error(root, saved_config, model)


def resharded_model_error(root: str, saved_config: dict, model) -> str | None:
    """The first architecture difference for a load that reshards the weights to this run's layout:
    the vocabulary's size and padding multiple must match, its padding for the tp size need not."""
    return _architecture_error(root, saved_config, model, _RESHARDED_ARCHITECTURE)


def architecture_fields() -> tuple[str, ...]:
    """The model fields that make a checkpoint's weights another architecture."""
    return tuple(name for name, _flag, _default in _ARCHITECTURE)


def architecture_record(model) -> dict:
    """The architecture a load at any layout must match, as plain values (a saved config's ``model``
    dict, or a model config): what a PEFT checkpoint records of its base."""
    return {
        name: _architecture_value(model, name, default) for name, _flag, default in _RESHARDED_ARCHITECTURE
    }


def architecture_difference(saved: dict, now: dict) -> tuple[str, str, object, object] | None:
    """``(field, flag, saved value, this value)`` for the first field two ``architecture_record``s differ
    in; None when they agree."""
    for name, flag, _default in _RESHARDED_ARCHITECTURE:
        if saved.get(name) != now.get(name):
            return name, flag, saved.get(name), now.get(name)
    return None
