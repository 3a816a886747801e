"""Megatron-LM's mixture-of-experts flags, a part of the one flag table (flags.py joins them in)."""

from __future__ import annotations

# Megatron-LM's mixture-of-experts flags (upstream's _add_moe_args); moe_arguments.moe_from_args maps
# what a row cannot (0 experts, a --moe-layer-freq expression, a list of one, a negative capacity).
MOE_FLAGS: list[tuple[str, str, str | None, object, str]] = [
    (
        "--num-experts",
        "model",
        "num_moe_experts",
        int,
        "Experts per MoE layer (default: none, a dense model; 0 too).",
    ),
    (
        "--moe-layer-freq",
        "model",
        "moe_layer_freq",
        str,
        "Which layers are MoE: every N-th (N), or 0/1 per layer, e.g. '([1]*3+[0]*1)*3' (default: 1).",
    ),
    (
        "--moe-ffn-hidden-size",
        "model",
        "moe_ffn_hidden_size",
        int,
        "Each expert's MLP hidden size (default: --ffn-hidden-size).",
    ),
    (
        "--moe-shared-expert-intermediate-size",
        "model",
        "moe_shared_expert_intermediate_size",
        int,
        "Shared experts' total MLP hidden size (default: no shared expert).",
    ),
    ("--moe-shared-expert-gate", "model", "moe_shared_expert_gate", "store_true", "Gate the shared expert."),
    ("--moe-router-topk", "model", "moe_router_topk", int, "Experts each token is routed to."),
    (
        "--moe-router-load-balancing-type",
        "model",
        "moe_router_load_balancing_type",
        "+",
        "aux_loss or none (one value; default: aux_loss).",
    ),
    (
        "--moe-aux-loss-coeff",
        "model",
        "moe_aux_loss_coeff",
        [float],
        "Load-balancing loss scale (one value; default: 0, none).",
    ),
    ("--moe-z-loss-coeff", "model", "moe_z_loss_coeff", float, "Router z-loss scale (default: none)."),
    ("--moe-router-score-function", "model", "moe_router_score_function", str, "softmax or sigmoid."),
    (
        "--moe-router-pre-softmax",
        "model",
        "moe_router_pre_softmax",
        "store_true",
        "Softmax over all experts before the top-k.",
    ),
    (
        "--moe-router-topk-scaling-factor",
        "model",
        "moe_router_topk_scaling_factor",
        float,
        "Scale the top-k routing probabilities (default: 1).",
    ),
    ("--moe-token-dispatcher-type", "model", "moe_token_dispatcher_type", str, "allgather or alltoall."),
    ("--moe-grouped-gemm", "model", "moe_grouped_gemm", "store_true", "All local experts in one GEMM."),
    (
        "--moe-expert-capacity-factor",
        "model",
        "moe_expert_capacity_factor",
        float,
        "Expert capacity over its balanced share (default, or negative: no token dropped).",
    ),
    (
        "--moe-pad-expert-input-to-capacity",
        "model",
        "moe_pad_expert_input_to_capacity",
        "store_true",
        "Pad each expert's input to its capacity.",
    ),
    ("--moe-token-drop-policy", "model", "moe_token_drop_policy", str, "Over capacity: probs or position."),
    ("--expert-model-parallel-size", "model", "expert_model_parallel_size", int, "Expert-parallel size."),
    (
        "--expert-tensor-parallel-size",
        "model",
        "expert_tensor_parallel_size",
        int,
        "Expert tensor-parallel size (default: --tensor-model-parallel-size).",
    ),
]
