"""Megatron-LM's own checkpoints, read as megatron_lite's.

Megatron-LM writes its parsed command line (``args``) into every checkpoint (``model_optim_rng.pt`` in
the ``torch`` format, ``common.pt`` in ``torch_dist``); ``megatron_lm_pickles`` rebuilds it as a dict
without running anything. The saved ``args`` then become the config and layout megatron_lite's loader
reads (``as_megatron_lite``): the architecture under our field names (Megatron-LM's
``load_args_from_checkpoint`` copies the same ones), the parallel layout, the iteration and consumed
samples. Model state dicts lose their ``_extra_state`` entries (Transformer Engine's FP8 metadata; our
layers have none) and take our names for Transformer Engine's fused norms (``linear_qkv.layer_norm_weight``
is ``input_layernorm.weight``).
"""

from __future__ import annotations

from megatron_lite.training.checkpointing import megatron_lm_optimizer
from megatron_lite.training.checkpointing.safety import CheckpointError
from megatron_lite.training.train_state import TrainState


def fields(value) -> dict | None:
    """A saved Namespace's fields: a dict as the stand-in rebuilt it, or ``vars()`` of a real one (where
    megatron.core was imported, it allowlists its own classes process-wide)."""
    if isinstance(value, dict):
        return value
    return vars(value) if hasattr(value, "__dict__") and not callable(value) else None


def is_megatron_lm(state) -> bool:
    """Whether a checkpoint file's dict was written by Megatron-LM (its ``args``, no megatron_lite config)."""
    return isinstance(state, dict) and fields(state.get("args")) is not None and "config" not in state


# Megatron-LM's argument name -> our model field, where they differ (the rest have the same name).
RENAMED = {
    "norm_epsilon": "layernorm_epsilon",
    "num_experts": "num_moe_experts",
    "use_rope_scaling": "rope_scaling",
    "rotary_seq_len_interpolation_factor": "seq_len_interpolation_factor",
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
}
SAME = (
    "num_layers hidden_size ffn_hidden_size num_attention_heads kv_channels max_position_embeddings "
    "seq_length position_embedding_type rotary_base rotary_percent rotary_interleaved "
    "rope_scaling_factor add_bias_linear add_qkv_bias normalization "
    "qk_layernorm init_method_std hidden_dropout attention_dropout apply_residual_connection_post_layernorm "
    "make_vocab_size_divisible_by tensor_model_parallel_size pipeline_model_parallel_size "
    "virtual_pipeline_model_parallel_size expert_model_parallel_size expert_tensor_parallel_size "
    "context_parallel_size sequence_parallel account_for_embedding_in_pipeline_split "
    "account_for_loss_in_pipeline_split moe_router_topk moe_ffn_hidden_size moe_layer_freq "
    "moe_shared_expert_intermediate_size moe_shared_expert_gate moe_router_load_balancing_type "
    "moe_aux_loss_coeff moe_z_loss_coeff moe_router_score_function moe_router_pre_softmax "
    "moe_router_enable_expert_bias moe_router_topk_scaling_factor moe_grouped_gemm "
    "moe_token_dispatcher_type"
).split()

# Megatron-LM features that change what the weights compute and that megatron_lite does not build:
# argument -> (what it is, whether the saved value uses it).
_UNSUPPORTED = {
    "apply_layernorm_1p": ("--apply-layernorm-1p (norm weights stored as weight - 1)", bool),
    "mtp_num_layers": ("multi-token prediction (--mtp-num-layers)", bool),
    "hybrid_layer_pattern": ("a hybrid (Mamba) model", bool),
    "hybrid_override_pattern": ("a hybrid (Mamba) model", bool),
    "heterogeneous_layers_config_path": ("heterogeneous layers", bool),
    "heterogeneous_layers_config_encoded_json": ("heterogeneous layers", bool),
    "multi_latent_attention": ("multi-latent attention (--multi-latent-attention)", bool),
    "window_size": ("sliding-window attention (--window-size)", bool),
    "no_rope_freq": ("layers without RoPE (--no-rope-freq)", bool),
    "qk_l2_norm": ("L2-normalised queries and keys (--qk-l2-norm)", bool),
    "glu_linear_offset": ("an offset GLU (--glu-linear-offset)", bool),
    "activation_func_clamp_value": ("a clamped activation", bool),
    "quick_geglu": ("quick GeGLU (--quick-geglu)", bool),
    "softmax_type": ("a softmax other than the vanilla one", lambda v: bool(v) and v != "vanilla"),
    "attention_output_gate": ("a gated attention output", bool),
    "experimental_attention_variant": ("an experimental attention variant", bool),
    "linear_attention_freq": ("linear-attention layers", bool),
    "moe_router_num_groups": ("group-limited MoE routing (--moe-router-num-groups)", bool),
}


def model_config(args: dict, where: str) -> dict:
    """Megatron-LM's saved arguments as our model config's fields (CheckpointError, one line, for a
    model megatron_lite does not build)."""
    for name, (what, used) in _UNSUPPORTED.items():
        if used(args.get(name)):
            raise CheckpointError(
                f"{where}: a Megatron-LM checkpoint of {what}, which megatron_lite does not build"
            )
    model = {name: args[name] for name in SAME if args.get(name) is not None}
    model |= {ours: args[theirs] for theirs, ours in RENAMED.items() if args.get(theirs) is not None}
    model["num_query_groups"] = args.get("num_query_groups") if args.get("group_query_attention") else None
    model["share_embeddings_and_output_weights"] = not args.get("untie_embeddings_and_output_weights", False)
    model["activation_func"] = (
        "silu"
        if args.get("swiglu")
        else "squared_relu"
        if args.get("squared_relu")
        else "openai_gelu"
        if args.get("openai_gelu")
        else "gelu"
    )
    model["gated_linear_unit"] = bool(args.get("swiglu"))
    # The embedding's rows, which Megatron-LM records (padded to a multiple of
    # make_vocab_size_divisible_by x tp, as we pad): the tokenizer's own size may be fewer.
    model["vocab_size"] = args.get("padded_vocab_size") or args.get("vocab_size")
    layers_per_chunk = args.get("num_layers_per_virtual_pipeline_stage")
    if layers_per_chunk and not model.get("virtual_pipeline_model_parallel_size"):
        per_stage = args["num_layers"] // args.get("pipeline_model_parallel_size", 1)
        model["virtual_pipeline_model_parallel_size"] = per_stage // layers_per_chunk
    return model


def parallel_layout(args: dict) -> dict:
    """The saving run's layout in ``metadata.json``'s form (expert sizes only where they are not a
    dense run's)."""
    tp = args.get("tensor_model_parallel_size", 1)
    layout = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": args.get("pipeline_model_parallel_size", 1),
        "data_parallel_size": args.get("data_parallel_size", 1),
    }
    ep, etp = args.get("expert_model_parallel_size", 1), args.get("expert_tensor_parallel_size") or tp
    if ep != 1 or etp != tp:
        layout |= {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}
    return layout


def train_state(state: dict) -> dict:
    """Our TrainState's tensors from Megatron-LM's iteration and the sample counts in its ``args``."""
    args = fields(state["args"])
    ts = TrainState(
        step=int(state.get("iteration", 0)),
        consumed_train_samples=int(args.get("consumed_train_samples") or 0),
        skipped_train_samples=int(args.get("skipped_train_samples") or 0),
        consumed_valid_samples=int(args.get("consumed_valid_samples") or 0),
        floating_point_operations_so_far=float(state.get("num_floating_point_operations_so_far") or 0),
    )
    return ts.state_dict()


# Transformer Engine fuses the layer norms into the next linear layer; megatron-core's local layers
# (and ours) keep them apart under these names. (Only the plain state dict of the ``torch`` format
# differs: megatron-core's sharded state dict, and so ``torch_dist``, uses Transformer Engine's names
# for both, as ours does.)
TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def local_key(key: str) -> str:
    """A Transformer Engine layer's key under megatron-core's local (and our) name."""
    for te, local in TE_NORMS.items():
        if key.endswith(te):
            return key[: -len(te)] + local
    return key


def model_state(state_dict: dict) -> dict:
    """A Megatron-LM model state dict as ours: without ``_extra_state``, with local norm names."""
    return {local_key(k): v for k, v in state_dict.items() if not k.endswith("_extra_state")}


def as_megatron_lite(state: dict, where: str, legacy: bool) -> dict:
    """A Megatron-LM checkpoint file's dict (a legacy shard or ``torch_dist``'s common state) with what
    megatron_lite's loader reads: ``config``, ``parallel_layout``, ``train_state``, its model state
    dicts as ours, and (``torch_dist``) the optimizer's common state as ours. The schedule's state is
    ours already (megatron-core's OptimizerParamScheduler, steps in samples). A ``torch``-format
    shard's optimizer state comes by parameter name (``megatron_lm["optimizer_by_name"]``). Not
    carried: the RNG streams (``rng_state`` None: the loader reseeds, and says so), an optimizer state
    megatron_lite cannot read (``megatron_lm["optimizer_error"]`` says why). ``legacy``: a
    ``torch``-format shard, not ``torch_dist``'s common state."""
    args = fields(state["args"])
    out = {
        k: (model_state(v) if k.startswith("model") and isinstance(v, dict) else v) for k, v in state.items()
    }
    out["config"] = {"model": model_config(args, where), "megatron_lm_args": dict(args)}
    out["parallel_layout"] = parallel_layout(args)
    out["train_state"] = train_state(state)
    if not legacy:
        optimizer, reason = megatron_lm_optimizer.common(state.get("optimizer"))
        out["megatron_lm"] = {"optimizer_error": reason}
    elif {k for k in state if k.startswith("model")} != {"model"}:
        optimizer, reason = None, "its virtual pipeline stages' optimizer state is not read yet"
        out["megatron_lm"] = {"optimizer_error": reason}
    else:
        optimizer = None
        by_name, reason = megatron_lm_optimizer.by_name(state.get("optimizer"), out["model"])
        out["megatron_lm"] = {"optimizer_error": reason, "optimizer_by_name": by_name}
    # Without an optimizer state to resume, what a weights-only load reads of it.
    out["optimizer"], out["rng_state"] = optimizer or {"fp32_param": False}, None
    return out


def optimizer_error(where: str, reason: str | None) -> str | None:
    """Why a resume cannot take a Megatron-LM checkpoint's optimizer state, one line; None if it can."""
    return reason and (
        f"{where}: a Megatron-LM checkpoint whose optimizer state megatron_lite cannot read yet ({reason}); "
        "--no-load-optim resumes the rest with a fresh optimizer, --finetune takes the weights only"
    )
