"""Which experts each token goes to, with megatron.core.transformer.moe.moe_utils' names and
formulas (re-exported there): top-k over softmax, sigmoid or sqrt-softplus scores (optionally within
the best groups of experts, biased per expert, or at indices the caller chose), the scores the
load-balancing loss uses, Sinkhorn balancing, the capacity an expert takes and token dropping, the
router's gating GEMM in its own dtype, random logits for load-balanced benchmarks, and the
aux-loss-free expert-bias update."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.core import parallel_state
from megatron_lite.core.tensor_parallel.random import get_cuda_rng_tracker

# Fused routing kernels come from Transformer Engine, which megatron_lite does not use.
_NO_FUSION = "fused MoE routing needs Transformer Engine, which megatron_lite does not use"


def get_capacity(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int | None = None
) -> int:
    """Tokens one expert takes: ``ceil(num_tokens / num_experts * capacity_factor)``, at least
    ``min_capacity``."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k within the ``group_topk`` best of ``num_groups`` equal expert groups, a group scored
    by the sum of its best ``topk / group_topk`` experts (DeepSeek's device / node-limited routing)."""
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
    masked = scores.masked_fill(~score_mask.reshape(num_tokens, -1).bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def _normalised_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    if score_function == "sqrtsoftplus":
        return F.softplus(logits.float()).sqrt()
    raise ValueError(f"Invalid score_function: {score_function}")


def topk_routing_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    fused: bool = False,
    router_replay=None,
    dense_output: bool = False,
    precomputed_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_probs, routing_map)``, both ``[tokens, experts]``: each token's top-k experts
    (``routing_map``) and their weights, zero elsewhere; with ``dense_output`` ``(probs, indices)``
    ``[tokens, topk]`` instead.

    softmax: over all experts before the top-k with ``use_pre_softmax``, else over the top-k logits
    (which equals renormalising the chosen experts' probabilities). sigmoid / sqrtsoftplus: the
    chosen experts' scores, renormalised to sum to one when topk > 1; ``expert_bias`` moves which
    experts are chosen, not their weights. ``precomputed_indices``: route to these experts."""
    if router_replay is not None:
        raise NotImplementedError("router replay is not supported by megatron_lite")
    if fused:
        raise ValueError(_NO_FUSION)
    num_tokens, num_experts = logits.shape

    def choose(scores):
        if precomputed_indices is not None:
            return torch.gather(scores, 1, precomputed_indices), precomputed_indices
        if group_topk:
            return group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if use_pre_softmax:
            probs, top_indices = choose(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            scores, top_indices = choose(logits)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        scores = _normalised_scores(logits, score_function)
        if expert_bias is not None and precomputed_indices is None:
            _, top_indices = choose(scores + expert_bias.float())
            scores = torch.gather(scores, 1, top_indices)
        else:
            scores, top_indices = choose(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    if dense_output:
        return probs, top_indices
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int).scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    fused: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map, scores)`` the load-balancing loss uses: the top-k over the normalised scores
    of all experts (softmax, or sigmoid / sqrt-softplus divided by their sum). ``padding_mask``
    [tokens], True at padding: those tokens count for nothing."""
    if fused:
        raise ValueError(_NO_FUSION)
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = _normalised_scores(logits, score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.int).scatter(1, top_indices, 1).bool()
    if padding_mask is not None:
        valid = (~padding_mask).unsqueeze(-1)
        routing_map, scores = routing_map & valid, scores * valid
    return routing_map, scores


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """``exp(cost)`` scaled by row and column factors until every expert takes an equal share
    (Sinkhorn-Knopp, to ``tol`` mean change of the column factors)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:  # note: a device sync per iteration
        d0 = (1 / d0.size(0)) / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def apply_router_token_dropping(
    routing_probs: torch.Tensor,
    routing_map: torch.Tensor,
    router_topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert keeps at most ``get_capacity(tokens x topk, experts, capacity_factor)`` tokens:
    those with the highest probabilities (``probs``) or the first ones (``position``). With
    ``pad_to_capacity`` every expert takes exactly that many (the extra ones with probability 0)."""
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        capacity_mask = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            ranking = routing_probs
        elif drop_policy == "position":
            ranking = routing_map.int()
        else:
            raise ValueError(f"Invalid drop_policy: {drop_policy}")
        # Ties (position: every chosen token scores 1) keep the earliest tokens: a stable sort.
        order = torch.sort(ranking, dim=0, descending=True, stable=True).indices[:capacity]
        capacity_mask = torch.zeros_like(routing_map).scatter(0, order, True)
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * final_map, final_map


class RouterGatingLinearFunction(torch.autograd.Function):
    """``inp @ weight.T (+ bias)`` computed in ``router_dtype``; saves the inputs in their own
    (usually bf16) dtype rather than the high-precision copies, and hands back gradients in the
    inputs' dtypes."""

    @staticmethod
    def forward(ctx, inp, weight, bias, router_dtype):
        ctx.save_for_backward(inp, weight, bias)
        ctx.router_dtype, ctx.input_dtype, ctx.weight_dtype = router_dtype, inp.dtype, weight.dtype
        flat = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
        w = weight.to(router_dtype).t()
        out = torch.mm(flat, w) if bias is None else torch.addmm(bias.to(router_dtype), flat, w)
        return out.view(*inp.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight, bias = ctx.saved_tensors
        grad = grad_output.reshape(-1, grad_output.shape[-1]).to(ctx.router_dtype)
        flat = inp.reshape(-1, inp.shape[-1]).to(ctx.router_dtype)
        grad_input = torch.mm(grad, weight.to(ctx.router_dtype)).to(ctx.input_dtype).view(inp.shape)
        grad_weight = torch.mm(grad.t(), flat).to(ctx.weight_dtype)
        grad_bias = grad.sum(dim=0).to(bias.dtype) if bias is not None else None
        return grad_input, grad_weight, grad_bias, None


def router_gating_linear(
    inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, router_dtype: torch.dtype
) -> torch.Tensor:
    """The router's logits in ``router_dtype`` from (usually bf16) input and weight."""
    return RouterGatingLinearFunction.apply(inp, weight, bias, router_dtype)


class RandomSTE(torch.autograd.Function):
    """Random normal logits (drawn from the expert-parallel stream, so each expert rank differs)
    whose backward passes the gradient straight through: a load-balanced benchmark's router."""

    @staticmethod
    def forward(ctx, logits):
        with get_cuda_rng_tracker().fork("expert-parallel-rng"):
            return logits.clone().normal_()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def apply_random_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits replaced by random ones (``moe_router_force_load_balancing``), gradients kept."""
    return RandomSTE.apply(logits)


def get_updated_expert_bias(
    tokens_per_expert: torch.Tensor,
    expert_bias: torch.Tensor,
    expert_bias_update_rate: float,
    tp_dp_cp_group=None,
) -> torch.Tensor:
    """The aux-loss-free bias (arXiv 2408.15664): each expert's bias moves by the update rate
    towards balance, up when it got fewer tokens than the mean, down when more. The counts are
    summed over ``tp_dp_cp_group`` (parallel_state's when None and initialised) in place."""
    with torch.no_grad():
        if tp_dp_cp_group is None and parallel_state.is_initialized():
            tp_dp_cp_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        if tp_dp_cp_group is not None and dist.get_world_size(tp_dp_cp_group) > 1:
            dist.all_reduce(tokens_per_expert, group=tp_dp_cp_group)
        average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        return expert_bias + torch.sign(average - tokens_per_expert) * expert_bias_update_rate
