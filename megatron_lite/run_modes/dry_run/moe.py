"""A MoE model's dry run: the routing it is measured under, and the grouped GEMM's fake kernel.

Fake tensors have no values, so a router's choices are unknown: the dispatchers take the rows each
expert receives from a routing plan (``planned_routing`` in core/transformer/moe/token_dispatcher.py)
and every op after them runs at those sizes, as the real code runs it. The plans, per rank's T tokens,
E experts, top-k and c the rows one expert takes of one rank (the capacity, T without a factor or when
the capacity exceeds T; predict/moe.py's ``routed_rows`` counts the same):

- with --moe-pad-expert-input-to-capacity every expert takes exactly c of every rank: the run's own
  routing, one plan;
- "balanced": every expert T k / E of every rank (the remainder to the first experts), at most c: a
  prediction;
- "worst": the measured rank's E_l local experts take as many of every rank's tokens as a router can
  send them (min(E_l c, T min(k, E_l)), spread evenly), the rest to the other experts, at most c each:
  a bound on what that rank's experts process.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.training.memory.predict.moe import capacity, exact_routing


def moe_routings(m) -> tuple[str | None, ...]:
    """The routings a stage is measured under, the one the preflight judges last: (None,) for a dense
    model, ("balanced",) where the config fixes the rows (padding to capacity: any plan is the run's
    routing), else ("balanced", "worst")."""
    if not m.num_moe_experts:
        return (None,)
    return ("balanced",) if exact_routing(m) else ("balanced", "worst")


def moe_layer_signature(m, pp_rank: int) -> tuple:
    """Which of stage ``pp_rank``'s layers are MoE layers, chunk by chunk (() for a dense model): with
    --moe-layer-freq, stages of the same depth may differ there."""
    if not m.num_moe_experts:
        return ()
    from megatron_lite.core.transformer.moe.moe_layer import moe_layer_pattern
    from megatron_lite.core.transformer.transformer_block import get_num_layers_to_build
    from megatron_lite.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = moe_layer_pattern(m)
    signature = []
    for vp_stage in range(m.virtual_pipeline_model_parallel_size or 1):
        offset = get_transformer_layer_offset(m, vp_stage, pp_rank)
        signature.append(tuple(pattern[offset : offset + get_num_layers_to_build(m, vp_stage, pp_rank)]))
    return tuple(signature)


def _spread(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal integers, the larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)] if parts else []


def routing_plan(m, routing: str):
    """``plan(tokens, num_experts, local_experts) -> rows of one rank's tokens per expert`` for
    ``routing`` ("balanced" or "worst"; with padding to capacity both are the exact rows)."""
    k = m.moe_router_topk

    def plan(tokens: int, experts: int, local: list[int]) -> list[int]:
        cap = capacity(m, tokens)
        per_expert = tokens if cap is None or cap > tokens else cap
        if exact_routing(m):
            return [per_expert] * experts
        if routing == "balanced":
            return [min(rows, per_expert) for rows in _spread(tokens * k, experts)]
        if routing != "worst":
            raise ValueError(f"routing must be 'balanced' or 'worst', got {routing!r}")
        mine = min(len(local) * per_expert, tokens * min(k, len(local)))
        others = [e for e in range(experts) if e not in local]
        rest = min(tokens * k - mine, len(others) * per_expert)
        counts = [0] * experts
        for e, rows in [*zip(local, _spread(mine, len(local))), *zip(others, _spread(rest, len(others)))]:
            counts[e] = rows
        return counts

    return plan


class _GroupedMMOfAnyFloat(TorchDispatchMode):
    """PyTorch's fake grouped_mm (its meta kernel) takes CUDA's bf16 only; the CPU kernel takes fp32 and
    fp16 too. For those: the meta on bf16 stand-ins, the output in the input's dtype (the stand-ins are
    internal to the op: the allocated-bytes tracker, entered above this mode, sees only the output)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled (as allocated.py's mode)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            dtype = args[0].dtype
            a, b = (t.to(torch.bfloat16) for t in args[:2])
            return func(a, b, *args[2:], **kwargs).to(dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def moe_dry_run(config, routing: str | None):
    """Within (under FakeTensorMode): the MoE layers route as ``routing`` plans; nothing for a dense model."""
    if routing is None:
        yield
        return
    from megatron_lite.core.transformer.moe.token_dispatcher import planned_routing

    with planned_routing(routing_plan(config.model, routing)), _GroupedMMOfAnyFloat():
        yield
