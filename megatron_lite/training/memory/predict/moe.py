"""Predicted parameters and saved activations of a MoE layer's MLP (core/transformer/moe/).

Parameters (:func:`moe_mlp_parameters`): the router's [E, h] weight and the shared expert (reduced
over data parallelism like the dense layers), and this rank's E / ep routed experts, each sliced over
the expert tensor-parallel ranks (fc1 by rows, fc2 by columns, fc2's bias whole); the routed experts
sit in DDP buffers of their own, padded and sharded over the expert data-parallel group
(tp cp dp / (etp ep) ranks) by the distributed optimizer.

Saved activations depend on how many rows the local experts process, which the routing decides.
:func:`routed_rows` gives (R rows this rank's experts take, P (token, expert) pairs this rank sorts)
per microbatch for T tokens per rank, E experts, top-k, E_l = E / ep local experts and the S = ep etp
ranks whose tokens reach them (the all-to-all's peers, or the all-gather's group):

- with --moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity every expert takes
  exactly c = ceil(T k / E cf) rows of every rank (T when c > T): R = S E_l c, exact;
- otherwise "balanced" routing gives every expert T k / E rows of every rank (at most c): a
  prediction, not a bound; "worst" routing sends every token of the S ranks to this rank's experts,
  min(k, E_l) rows each (at most E_l c with a capacity factor): a bound nothing exceeds.

What autograd saves (measured op by op on CPU, :func:`moe_mlp_saves`; e the activation element
size, F1 = fc1's rows per expert (2f gated), f = moe_ffn_hidden_size / etp): the router's input is
the norm output already counted; top-k's indices T k 8 and the softmax over them T k 4 (fp32); the
load-balancing loss's softmax over all experts T E 4 (its top-k's indices are released with the
unused values); a capacity factor's mask T E 1 (its sort's indices go with the unused values); the
dispatcher's sorted (expert, token) indices 16 P (16 R for all-gather, which sorts only the local
experts' pairs); the experts' input R h e (the grouped GEMM keeps its weights, not the stacked copy it
reads), fc1's output R F1 e, the activation
(SwiGLU, fused: nothing more; another gated one: act(gate) and its product with value R f e each,
else R f e), the probabilities R e and
fc2's input R f e; with biases the grouped path's row-to-expert index R 8 twice and the fc2 bias
rows R h e; the combine keeps its indices only (moe_utils.combine_rows, as megatron-core's
scatter_add). The shared expert saves a dense MLP's tensors (and with its gate T e + T h e).
"""

from __future__ import annotations

from megatron_lite.core.fusions.fused_bias_swiglu import fuses
from megatron_lite.core.transformer.moe.moe_layer import moe_layer_pattern
from megatron_lite.core.transformer.moe.moe_utils import get_capacity

ROUTINGS = ("balanced", "worst")


def is_moe(m, layer_index: int) -> bool:
    """Whether global layer ``layer_index`` (0-based) of ``m`` is a MoE layer."""
    return bool(m.num_moe_experts) and bool(moe_layer_pattern(m)[layer_index])


def expert_sizes(m) -> tuple[int, int, int]:
    """(local experts E_l, expert tensor-parallel size etp, expert-parallel size ep)."""
    ep = m.expert_model_parallel_size
    etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    return m.num_moe_experts // ep, etp, ep


def expert_data_parallel_size(config) -> int:
    """The ranks an expert's gradients are reduced (and its optimizer state sharded) over."""
    m = config.model
    _, etp, ep = expert_sizes(m)
    return m.tensor_model_parallel_size * m.context_parallel_size * config.data_parallel_size // (etp * ep)


def moe_mlp_parameters(prefix: str, m, spec) -> tuple[list, list]:
    """(dense, expert) ParamSpecs of a MoE layer's ``mlp``, built with ``spec(name, numel, ndim)``."""
    h, tp = m.hidden_size, m.tensor_model_parallel_size
    local, etp, _ = expert_sizes(m)
    gated = 2 if m.gated_linear_unit else 1
    f = m.moe_ffn_hidden_size // etp
    dense = [spec(f"{prefix}.router.weight", m.num_moe_experts * h, 2)]
    experts = []
    for i in range(local):
        if m.moe_grouped_gemm:
            fc1, fc2, sfx = f"{prefix}.experts.linear_fc1", f"{prefix}.experts.linear_fc2", str(i)
        else:
            base = f"{prefix}.experts.local_experts.{i}"
            fc1, fc2, sfx = f"{base}.linear_fc1", f"{base}.linear_fc2", ""
        experts.append(spec(f"{fc1}.weight{sfx}", f * gated * h, 2))
        if m.add_bias_linear:
            experts.append(spec(f"{fc1}.bias{sfx}", f * gated, 1))
        experts.append(spec(f"{fc2}.weight{sfx}", h * f, 2))
        if m.add_bias_linear:
            experts.append(spec(f"{fc2}.bias{sfx}", h, 1))
    if shared := m.moe_shared_expert_intermediate_size:
        s = f"{prefix}.shared_experts"
        dense.append(spec(f"{s}.linear_fc1.weight", shared * gated // tp * h, 2))
        if m.add_bias_linear:
            dense.append(spec(f"{s}.linear_fc1.bias", shared * gated // tp, 1))
        dense.append(spec(f"{s}.linear_fc2.weight", h * shared // tp, 2))
        if m.add_bias_linear:
            dense.append(spec(f"{s}.linear_fc2.bias", h, 1))
        if m.moe_shared_expert_gate:
            dense.append(spec(f"{s}.gate_weight", h, 2))
    return dense, experts


def capacity(m, tokens: int) -> int | None:
    """Rows one expert takes of one rank's ``tokens`` (upstream's get_capacity), None without a factor."""
    cf = m.moe_expert_capacity_factor
    return None if cf is None else get_capacity(tokens * m.moe_router_topk, m.num_moe_experts, cf)


def exact_routing(m) -> bool:
    """Whether the rows each expert takes are fixed by the config (a capacity factor with padding)."""
    return m.moe_expert_capacity_factor is not None and m.moe_pad_expert_input_to_capacity


def judged_routing(m) -> str | None:
    """The routing a memory verdict on ``m`` judges: None for a dense model, "exact" when padding to
    capacity fixes the rows, else "worst" (the bound: balanced routing is a prediction that holds only
    while load balancing does)."""
    if not m.num_moe_experts:
        return None
    return "exact" if exact_routing(m) else "worst"


def routed_rows(m, tokens: int, routing: str = "balanced") -> tuple[float, float]:
    """(R, P) per microbatch: rows this rank's local experts process, (token, expert) pairs this rank
    sorts for the all-to-all. Exact with padding to capacity; else ``routing`` "balanced" (a
    prediction) or "worst" (an upper bound)."""
    local, etp, ep = expert_sizes(m)
    experts, k, sources = m.num_moe_experts, m.moe_router_topk, ep * etp
    cap = capacity(m, tokens)
    per_expert = tokens if cap is None or cap > tokens else cap  # the most one expert takes of a rank
    if exact_routing(m):
        return sources * local * per_expert, experts * per_expert
    if routing == "balanced":
        each = min(tokens * k / experts, per_expert)
        return sources * local * each, experts * each
    if routing != "worst":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    rows = min(local * per_expert, tokens * min(k, local))
    return sources * rows, min(tokens * k, experts * per_expert)


def moe_mlp_saves(x, routing: str = "balanced") -> dict[str, float]:
    """What a MoE layer's ``mlp`` saves in one microbatch's forward beyond its input (``x`` a Shape),
    for ``routing`` (ignored when the config fixes the rows)."""
    m, e, h = x.m, x.elt, x.m.hidden_size
    t = x.norm_tokens  # the router and dispatcher see this rank's (sequence-parallel) tokens
    experts, k = m.num_moe_experts, m.moe_router_topk
    local, etp, _ = expert_sizes(m)
    f = m.moe_ffn_hidden_size // etp
    gated = m.gated_linear_unit
    rows, pairs = routed_rows(m, t, routing)
    saves = {"router.topk.indices": t * k * 8, "router.probs": t * k * 4}
    if m.moe_router_load_balancing_type == "aux_loss" and m.moe_aux_loss_coeff:
        saves["router.aux.scores"] = t * experts * 4 + experts * 8 + 4
    cap = capacity(m, t)
    if cap is not None:
        saves["router.capacity.mask"] = t * experts
    allgather = m.moe_token_dispatcher_type == "allgather"
    saves["dispatcher.indices"] = 16 * (rows if allgather else pairs)
    if m.moe_grouped_gemm and m.add_bias_linear:
        saves["experts.bias"] = rows * 16 + rows * h * e
    saves["experts.input"] = rows * h * e
    saves["experts.fc1.output"] = rows * f * (2 if gated else 1) * e
    # Fused SwiGLU (fusions/fused_bias_swiglu) saves fc1's output and the probabilities only.
    saves["experts.activation"] = 0 if fuses(m) else rows * f * e * (2 if gated else 1)
    saves["experts.probs"] = rows * e
    saves["experts.fc2.input"] = rows * f * e
    if shared := m.moe_shared_expert_intermediate_size:
        width = shared // m.tensor_model_parallel_size
        saves["shared.fc1.output"] = x.tokens * width * (2 if gated else 1) * e
        if gated and not fuses(m):
            saves["shared.activation.output"] = x.tokens * width * e
        saves["shared.fc2.input"] = x.tokens * width * e
        if m.moe_shared_expert_gate:
            saves["shared.gate"] = t * e + t * h * e
    return saves
