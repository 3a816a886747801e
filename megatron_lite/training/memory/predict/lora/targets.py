"""Which linears LoRA adapts (Bridge's matching on chunk-local paths) and the adapters' parameters
(see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

COLUMN, ROW = "column", "row"


def lora_of(config):
    """The run's LoRA (``config.peft`` when it is one: it has a ``dim``), else None."""
    peft = getattr(config, "peft", None)
    return peft if peft is not None and hasattr(peft, "dim") else None


def _wildcard_match(pattern: str, key: str) -> bool:
    from megatron_lite.peft.utils import wildcard_match  # the transform's own rule

    return bool(wildcard_match(pattern, key))


def is_adapted(lora, full_name: str) -> bool:
    """Whether LoRA wraps the linear at chunk-local path ``full_name`` (Bridge's ModuleMatcher: a
    target is the module's own name or a wildcard over the path; with no targets every linear not
    excluded)."""
    if lora is None:
        return False
    name = full_name.rsplit(".", 1)[-1]
    targets = list(getattr(lora, "target_modules", None) or [])
    if targets:
        return any(name == p or _wildcard_match(p, full_name) for p in targets)
    excluded = list(getattr(lora, "exclude_modules", None) or [])
    return not (name in excluded or any(_wildcard_match(p, full_name) for p in excluded))


@dataclass(frozen=True)
class Linear:
    """A linear of a layer as LoRA sees it: its path in the layer, kind, whole in/out features, the
    TP size its weight is split over, whether it is a routed expert's."""

    path: str
    kind: str
    in_features: int
    out_features: int
    tp: int
    expert: bool = False


def dense_linears(m) -> list[Linear]:
    """The attention's and the dense MLP's linears of a layer."""
    tp, h = m.tensor_model_parallel_size, m.hidden_size
    groups = m.num_query_groups or m.num_attention_heads
    query = m.kv_channels * m.num_attention_heads
    qkv = query + 2 * m.kv_channels * groups
    fc1 = m.ffn_hidden_size * (2 if m.gated_linear_unit else 1)
    return [
        Linear("self_attention.linear_qkv", COLUMN, h, qkv, tp),
        Linear("self_attention.linear_proj", ROW, query, h, tp),
        Linear("mlp.linear_fc1", COLUMN, h, fc1, tp),
        Linear("mlp.linear_fc2", ROW, m.ffn_hidden_size, h, tp),
    ]


def moe_linears(m, local_experts: int, etp: int) -> list[Linear]:
    """A MoE layer's routed experts' linears (one grouped pair, or a pair per local expert) and its
    shared expert's."""
    h, gated = m.hidden_size, 2 if m.gated_linear_unit else 1
    f = m.moe_ffn_hidden_size
    if m.moe_grouped_gemm:
        bases = ["mlp.experts"]
    else:
        bases = [f"mlp.experts.local_experts.{i}" for i in range(local_experts)]
    linears = []
    for base in bases:
        linears.append(Linear(f"{base}.linear_fc1", COLUMN, h, f * gated, etp, expert=True))
        linears.append(Linear(f"{base}.linear_fc2", ROW, f, h, etp, expert=True))
    if shared := m.moe_shared_expert_intermediate_size:
        tp = m.tensor_model_parallel_size
        linears.append(Linear("mlp.shared_experts.linear_fc1", COLUMN, h, shared * gated, tp))
        linears.append(Linear("mlp.shared_experts.linear_fc2", ROW, shared, h, tp))
    return linears


def adapter_shapes(linear: Linear, dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(linear_in's, linear_out's) weight shape on one TP rank, as Bridge's ParallelLinearAdapter."""
    tp = linear.tp
    if linear.kind == COLUMN:
        return (dim // tp, linear.in_features), (linear.out_features // tp, dim)
    return (dim, linear.in_features // tp), (linear.out_features // tp, dim)


def adapter_parameters(prefix: str, linear: Linear, dim: int, spec, stacked: int = 1) -> list:
    """The adapter's two parameters of the linear at ``prefix``, built with
    ``spec(name, numel, ndim, expert=...)``; ``stacked``: a pair per local expert in one tensor each
    (a grouped expert linear without ``share_expert_adapters``)."""
    (a, b), (c, d) = adapter_shapes(linear, dim)
    ndim = 3 if stacked > 1 else 2
    return [
        spec(f"{prefix}.adapter.linear_in.weight", stacked * a * b, ndim, expert=linear.expert),
        spec(f"{prefix}.adapter.linear_out.weight", stacked * c * d, ndim, expert=linear.expert),
    ]


def expert_adapter_dim(lora, m, linear: Linear) -> int:
    """A routed expert's adapter rank: ``dim // topk`` with ``normalize_moe_lora`` (a column base's
    rounded up to the expert TP size), else ``dim``."""
    if not getattr(lora, "normalize_moe_lora", False) or not linear.expert:
        return lora.dim
    dim = lora.dim // m.moe_router_topk
    return -(-dim // linear.tp) * linear.tp if linear.kind == COLUMN else dim
