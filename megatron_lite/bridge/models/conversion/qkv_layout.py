"""Megatron's fused attention projections, in Megatron-Bridge's helper names.

``linear_qkv`` is group-major: for each query group, its query heads' rows, then its key head's, then
its value head's; ``linear_kv`` the same without queries. Weights ([rows, hidden]) and biases ([rows])
share one layout, so every helper here is one of two moves: interleave per group, split per group.
"""

from __future__ import annotations

import torch


def head_dim(config) -> int:
    return config.kv_channels or config.hidden_size // config.num_attention_heads


def interleave_groups(parts, groups: int) -> torch.Tensor:
    """``parts`` (each ``groups`` blocks of rows) as one tensor: group 0's block of each part in turn,
    then group 1's, and so on."""
    rest = parts[0].shape[1:]
    return torch.cat([p.reshape(groups, -1, *rest) for p in parts], dim=1).reshape(-1, *rest)


def split_groups(fused: torch.Tensor, groups: int, rows: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The inverse of ``interleave_groups``: ``rows`` per group for each part, in order."""
    rest = fused.shape[1:]
    pieces = fused.reshape(groups, sum(rows), *rest).split(list(rows), dim=1)
    return tuple(p.reshape(-1, *rest) for p in pieces)


def _qkv_rows(config) -> tuple[int, int, int]:
    d = head_dim(config)
    return d * (config.num_attention_heads // config.num_query_groups), d, d


def merge_qkv_weights(provider, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return interleave_groups((q, k, v), provider.num_query_groups)


def split_qkv_weights(provider, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return split_groups(qkv, provider.num_query_groups, _qkv_rows(provider))


def merge_kv_weights(provider, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return interleave_groups((k, v), provider.num_query_groups)


def split_kv_weights(provider, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = head_dim(provider)
    return split_groups(kv, provider.num_query_groups, (d, d))


# Biases are the 1-D case of the same layout.
merge_qkv_biases, split_qkv_biases = merge_qkv_weights, split_qkv_weights
merge_kv_biases, split_kv_biases = merge_kv_weights, split_kv_weights
