"""Checks of the mixture-of-experts options, run by validate with the other config checks: upstream's
rules (its validate_args and TransformerConfig.__post_init__), and refusals of what megatron_lite's MoE
layer does not do yet. Each failure is one ConfigError naming the flag and the fix. Whether the expert
grid fits the world is validate/layout.py's check."""

from __future__ import annotations

from dataclasses import MISSING, fields

from megatron_lite.training.cli.flags import FLAGS
from megatron_lite.training.errors import ConfigError

# Every --moe-* flag and its model field: each needs --num-experts when set away from its default.
MOE_FIELDS = {flag: name for flag, _section, name, _kind, _help in FLAGS if flag.startswith("--moe-")}

LOAD_BALANCING_TYPES = ("aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
TOKEN_DISPATCHERS = ("allgather", "alltoall")
TOKEN_DROP_POLICIES = ("probs", "position")
# The load balancing a capacity factor works with (upstream's list; megatron_lite has aux_loss and none).
CAPACITY_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
# Upstream's choices that megatron_lite's router and dispatcher do not implement yet.
NOT_YET = {
    "--moe-router-load-balancing-type": ("seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing"),
    "--moe-token-dispatcher-type": ("flex",),
}


def check_moe(cfg) -> None:
    m = cfg.model
    experts, ep = m.num_moe_experts, m.expert_model_parallel_size
    if experts is None:
        _check_dense(m)
        return
    if experts < 1:
        raise ConfigError("--num-experts", f"must be >= 1 (or None for a dense model), got {experts}")
    if experts % ep:
        raise ConfigError(
            "--expert-model-parallel-size",
            f"{experts} experts do not split over {ep} expert-parallel ranks; use a divisor of --num-experts",
        )
    if not 1 <= m.moe_router_topk <= experts:
        raise ConfigError(
            "--moe-router-topk", f"must be between 1 and --num-experts {experts}, got {m.moe_router_topk}"
        )
    _check_layer_freq(m.moe_layer_freq, m.num_layers)
    _check_router(m)
    _check_capacity(m)
    if m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size is None:
        raise ConfigError(
            "--moe-shared-expert-gate",
            "needs --moe-shared-expert-intermediate-size (upstream ignores it without)",
        )
    _check_parallelism(m)


def _check_dense(m) -> None:
    """A dense model: no MoE option may be set (upstream refuses --moe-ffn-hidden-size alone)."""
    defaults = {f.name: f.default for f in fields(m) if f.default is not MISSING}
    for flag, name in MOE_FIELDS.items():
        if getattr(m, name) != defaults[name]:
            raise ConfigError(flag, "needs --num-experts")
    if m.expert_model_parallel_size > 1:
        raise ConfigError("--expert-model-parallel-size", "needs --num-experts")


def _check_layer_freq(freq, num_layers: int) -> None:
    flag = "--moe-layer-freq"
    if isinstance(freq, list):
        if any(type(x) is not int or x not in (0, 1) for x in freq):
            raise ConfigError(flag, f"a list must hold only 0 (dense) and 1 (MoE), got {freq}")
        if len(freq) != num_layers:
            raise ConfigError(
                flag, f"has {len(freq)} entries; it needs one per layer (--num-layers {num_layers})"
            )
    elif type(freq) is not int:
        raise ConfigError(flag, f"must be an integer or a list of 0/1 per layer, got {freq!r}")
    elif freq < 1:
        raise ConfigError(flag, f"must be >= 1 (every N-th layer is MoE), got {freq}")


def _one_value(flag: str, value):
    """Upstream also takes lists (several load-balancing losses at once); the command line turns a
    list of one into its value."""
    if isinstance(value, (list, tuple)):
        raise ConfigError(
            flag, f"takes one value in megatron_lite (several are not supported yet), got {list(value)}"
        )
    return value


def _choice(flag: str, value, allowed: tuple[str, ...]) -> None:
    if value in NOT_YET.get(flag, ()):
        raise ConfigError(
            flag, f"{value!r} is not supported yet by megatron_lite; use {' or '.join(allowed)}"
        )
    if value not in allowed:
        raise ConfigError(flag, f"must be {' or '.join(allowed)}, got {value!r}")


def _check_router(m) -> None:
    balancing = _one_value("--moe-router-load-balancing-type", m.moe_router_load_balancing_type)
    coeff = _one_value("--moe-aux-loss-coeff", m.moe_aux_loss_coeff)
    if m.moe_expert_capacity_factor is not None and balancing not in CAPACITY_BALANCING_TYPES:
        raise ConfigError(
            "--moe-expert-capacity-factor",
            f"only works with aux_loss or none load balancing (as upstream), not {balancing!r}",
        )
    _choice("--moe-router-load-balancing-type", balancing, LOAD_BALANCING_TYPES)
    for flag, value in (("--moe-aux-loss-coeff", coeff), ("--moe-z-loss-coeff", m.moe_z_loss_coeff)):
        if value is not None and not value >= 0:
            raise ConfigError(flag, f"must be >= 0, got {value}")
    _choice("--moe-router-score-function", m.moe_router_score_function, SCORE_FUNCTIONS)
    _choice("--moe-token-dispatcher-type", m.moe_token_dispatcher_type, TOKEN_DISPATCHERS)
    _choice("--moe-token-drop-policy", m.moe_token_drop_policy, TOKEN_DROP_POLICIES)


def _check_capacity(m) -> None:
    capacity = m.moe_expert_capacity_factor
    if capacity is not None and not capacity > 0:
        raise ConfigError(
            "--moe-expert-capacity-factor",
            f"must be positive, got {capacity} (leave it out, or None, for no capacity limit)",
        )
    if m.moe_pad_expert_input_to_capacity and capacity is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor")


def _check_parallelism(m) -> None:
    tp = m.tensor_model_parallel_size
    if tp > 1 and not m.sequence_parallel:
        # Upstream only warns; without it every TP rank dispatches the same tokens as its own, so
        # the experts see each token tp times and their gradients add up tp times.
        raise ConfigError(
            "--num-experts", f"with --tensor-model-parallel-size {tp} needs --sequence-parallel"
        )
    etp = m.expert_tensor_parallel_size or tp
    if m.moe_ffn_hidden_size % etp:
        raise ConfigError(
            "--moe-ffn-hidden-size",
            f"{m.moe_ffn_hidden_size} does not split over expert tensor parallel size {etp}; use a multiple of {etp}",
        )
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ConfigError(
            "--moe-shared-expert-intermediate-size",
            f"{shared} does not split over tensor parallel size {tp}; use a multiple of {tp}",
        )
    if etp > 1 and m.add_bias_linear:
        defaulted = (
            " (its default, --tensor-model-parallel-size)" if m.expert_tensor_parallel_size is None else ""
        )
        raise ConfigError(
            "--expert-tensor-parallel-size",
            f"expert biases need expert tensor parallel size 1 (or --disable-bias-linear), got {etp}{defaulted}",
        )
