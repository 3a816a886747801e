"""Mixture-of-experts parameters in the bridge: named by global expert index, split over the
expert-tensor-parallel ranks (routed experts) or the tensor-parallel ranks (the shared expert).

A rank holds ``num_moe_experts / ep`` routed experts, numbered locally (``linear_fc1.weight<i>``,
``local_experts.<i>.``) from its ``local_expert_offset``; the bridge names them by global index, as
Hugging Face does, so each rank reads its own experts. Under expert tensor parallelism an expert's
``linear_fc1`` splits by rows (gated: each rank's gate rows, then its up rows) and ``linear_fc2`` by
columns, as the dense MLP's do; the router and the shared expert's gate are whole on every rank.
"""

from __future__ import annotations

import re

import torch

from megatron_lite.core.models.gpt.expert_sharding import expert_split_dim
from megatron_lite.core.models.gpt.state_dict_sharding import merge_tp_shards, tp_split_dim

_GROUPED = re.compile(r"^(linear_fc[12]\.(?:weight|bias))(\d+)$")
_SEQUENTIAL = re.compile(r"^local_experts\.(\d+)\.(.*)$")


def is_expert_param(name: str) -> bool:
    """A routed expert's parameter: split over the expert-tensor-parallel group, not the TP one."""
    return ".mlp.experts." in name


def local_to_global(name: str, offset: int) -> str:
    """``name`` (relative to an experts module) with its local expert index made global."""
    grouped = _GROUPED.match(name)
    if grouped:
        return f"{grouped.group(1)}{int(grouped.group(2)) + offset}"
    sequential = _SEQUENTIAL.match(name)
    if sequential:
        return f"local_experts.{int(sequential.group(1)) + offset}.{sequential.group(2)}"
    return name


def named_parameters(chunk):
    """``chunk.named_parameters()`` with each routed expert named by its global index."""
    offsets = {
        prefix + ".": module.local_expert_offset
        for prefix, module in chunk.named_modules()
        if hasattr(module, "local_expert_offset")
    }
    for name, param in chunk.named_parameters():
        for prefix, offset in offsets.items():
            if name.startswith(prefix) and offset:
                name = prefix + local_to_global(name[len(prefix) :], offset)
                break
        yield name, param


def split_dim(name: str) -> int | None:
    """The dim a parameter splits along over its tensor-parallel ranks (None: whole on each): a routed
    expert's over expert TP, anything else (the shared expert too) as the dense layers over TP."""
    return expert_split_dim(name) if is_expert_param(name) else tp_split_dim(name)


def merge_shards(name: str, shards: list[torch.Tensor], config) -> torch.Tensor:
    """The whole tensor from every tensor-parallel rank's part, in rank order."""
    if not is_expert_param(name):
        return merge_tp_shards(name, shards, gated=config.gated_linear_unit, vocab_size=config.vocab_size)
    dim = expert_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if dim == 0 and config.gated_linear_unit:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([g for g, _ in halves] + [u for _, u in halves])
    return torch.cat(shards, dim=dim)
