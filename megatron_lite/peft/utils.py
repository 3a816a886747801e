"""Helpers of the PEFT layers (Megatron-Bridge's ``peft.utils``): wildcard matching, the adapters'
initialisers (from ``init_methods``), what a base linear layer tells its adapter
(``get_adapter_attributes_from_linear``) and which names are routed experts. The adapter itself,
``ParallelLinearAdapter``, lives in ``parallel_adapter`` and is importable from here, as in Bridge."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from megatron_lite.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.core.transformer.moe.experts import ExpertLinear
from megatron_lite.peft.expert_adapters import GroupedExpertLinearAdapter
from megatron_lite.peft.init_methods import (
    INIT_METHODS,
    get_init_fn,
    init_method_const,
    init_method_kaiming_uniform,
    init_method_normal,
)
from megatron_lite.peft.parallel_adapter import ParallelLinearAdapter

__all__ = [
    "INIT_METHODS",
    "AdapterAttributes",
    "GroupedExpertLinearAdapter",
    "ParallelLinearAdapter",
    "get_adapter_attributes_from_linear",
    "get_effective_lora_dim",
    "get_init_fn",
    "init_method_const",
    "init_method_kaiming_uniform",
    "init_method_normal",
    "is_adapter_key",
    "is_expert_linear",
    "is_grouped_expert_linear",
    "wildcard_match",
]


def wildcard_match(pattern: str, key: str | None) -> bool | None:
    """Whether ``key`` (a module's full name) matches ``pattern``, where ``*`` stands for any
    substring, dots included (``"*.layers.0.*.linear_qkv"`` matches
    ``decoder.layers.0.self_attention.linear_qkv``); None when there is no key. Every other
    character is literal except as a regular expression (Bridge builds the same regex)."""
    if key is None:
        return None
    return re.match("^" + pattern.replace("*", "(.*)") + "$", key) is not None


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key belongs to an adapter: what a PEFT checkpoint holds."""
    return "adapter." in key


@dataclass(frozen=True)
class AdapterAttributes:
    """What an adapter needs to know of its base linear layer (sizes are the full, unsplit ones)."""

    input_is_parallel: bool
    in_features: int
    out_features: int
    disable_tensor_parallel_comm: bool
    disable_sequence_parallel_comm: bool
    base_linear_is_parallel: bool


def expert_linear_is_row_parallel(m: ExpertLinear) -> bool:
    """fc2 of the experts is split by input columns (``partition_dim`` 1), fc1 by output rows."""
    return getattr(m.weights()[0], "partition_dim", 0) == 1


def get_adapter_attributes_from_linear(
    m: nn.Module, is_expert: bool = False, sequence_parallel_input_regather: bool = False
) -> AdapterAttributes:
    """The adapter attributes of base layer ``m``: a ColumnParallelLinear's input is whole (the
    adapter's ``linear_in`` is column-parallel), a RowParallelLinear's is split (row-parallel
    ``linear_in``); an expert linear is one or the other by how its weights are split. Sequence
    parallelism concerns a dense layer only (the token dispatcher feeds the experts whole rows).
    ``sequence_parallel_input_regather`` (Bridge's memory option) changes nothing here."""
    if isinstance(m, ColumnParallelLinear | RowParallelLinear):
        explicit = bool(getattr(m, "explicit_expert_comm", False))
        sp_off = not m.config.sequence_parallel or explicit
        return AdapterAttributes(
            input_is_parallel=isinstance(m, RowParallelLinear),
            in_features=m.input_size,
            out_features=m.output_size,
            disable_tensor_parallel_comm=explicit,
            disable_sequence_parallel_comm=sp_off,
            base_linear_is_parallel=True,
        )
    if isinstance(m, ExpertLinear):
        out_local, in_local = m.weights()[0].shape
        etp = m.etp[1]
        row = expert_linear_is_row_parallel(m)
        return AdapterAttributes(
            input_is_parallel=row,
            in_features=in_local * etp if row else in_local,
            out_features=out_local if row else out_local * etp,
            disable_tensor_parallel_comm=True,
            disable_sequence_parallel_comm=True,
            base_linear_is_parallel=True,
        )
    raise ValueError(f"LoRA cannot wrap a {type(m).__name__}: only tensor-parallel and expert linear layers")


def is_expert_linear(fqn: str) -> bool:
    """Whether a module's full name is a routed expert's linear (not a shared expert's):
    ``decoder.layers.0.mlp.experts.linear_fc1`` or ``...mlp.experts.local_experts.3.linear_fc2``."""
    return re.match(r".*mlp\..*experts.*\.linear_fc[1-2]$", fqn) is not None and ".shared_experts." not in fqn


def is_grouped_expert_linear(fqn: str) -> bool:
    """An expert linear holding all local experts' weights (TEGroupedMLP's), not one expert's."""
    return is_expert_linear(fqn) and ".local_experts." not in fqn


def get_effective_lora_dim(
    module: nn.Module, *, dim: int, normalize_moe_lora: bool, is_expert: bool, topk=None
) -> int:
    """The rank an adapter gets: ``dim``, or ``dim // moe_router_topk`` for an expert under
    ``normalize_moe_lora`` (so the adapters a token passes through add up to ``dim``)."""
    if not normalize_moe_lora or not is_expert:
        return dim
    if topk is None:
        topk = getattr(getattr(module, "config", None), "moe_router_topk", None)
    if not topk or topk <= 0:
        raise ValueError(f"normalize_moe_lora needs a positive moe_router_topk, not {topk!r}")
    if dim % topk:
        raise ValueError(
            f"LoRA dim={dim} must be divisible by moe_router_topk={topk} under normalize_moe_lora"
        )
    return dim // topk
