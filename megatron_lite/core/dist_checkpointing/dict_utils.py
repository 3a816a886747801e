"""Walking nested state dicts (megatron-core's ``dist_checkpointing.dict_utils``): dicts and lists are
the branches, anything else a leaf."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def nested_values(x: dict | list):
    """Every leaf under ``x``, depth first."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Replace every leaf ``v`` under ``x`` by ``f(v)`` in place; a leaf ``x`` itself is returned mapped."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
    else:
        return f(x)
    return x


def extract_matching_values(
    x: dict | list, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[Any, Any]:
    """``x`` split into the leaves ``predicate`` holds for and the rest, each keeping the nesting (a
    branch left without leaves is dropped from the matching part; an empty one stays in the other).
    ``return_lists_as_dicts``: lists become dicts by index, so the parts can be put back in place."""
    if not isinstance(x, (dict, list)):
        raise ValueError(f"Unexpected top-level object type: {type(x)}")
    as_dict = isinstance(x, dict) or return_lists_as_dicts
    match, rest = ({}, {}) if as_dict else ([], [])

    def put(target, k, v):
        if as_dict:
            target[k] = v
        else:
            target.append(v)

    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)) and (v or isinstance(x, dict)):
            m, r = extract_matching_values(v, predicate, return_lists_as_dicts)
            if m:
                put(match, k, m)
            if r or not v:
                put(rest, k, r)
        else:
            put(match if predicate(v) else rest, k, v)
    return match, rest


def merge(x1: dict | list, x2: dict | list, key: tuple = ()) -> dict | list:
    """``x2`` merged into ``x1`` in place (dicts by key, lists of equal length by position); ``key``:
    where we are, for errors."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"Cannot merge two lists with different lengths ({len(x1)} and {len(x2)}) at {key}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
    else:
        raise ValueError(f"Duplicate non-dict and non-list values encountered: `{x1}` and `{x2}` (at {key})")
    return x1


def _leaves_differ(x1: Any, x2: Any) -> bool:
    if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        try:
            return not bool(torch.all(x1.cpu() == x2.cpu()))
        except (RuntimeError, TypeError, ValueError):  # shapes that do not broadcast
            return True
    try:
        return bool(x1 != x2)
    except RuntimeError:
        return True


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """Where two nested state dicts differ: (paths only in ``x1``, paths only in ``x2``, and
    ``(path, type of x1's value, type of x2's value)`` for the values in both that differ; tensors
    compare element by element, sharded objects by their data)."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        pairs = [(k, x1[k], x2[k]) for k in x2.keys() & x1.keys()]
    elif isinstance(x1, (list, tuple)) and type(x1) is type(x2):
        only_left = list(range(len(x1) - 1, len(x2) - 1, -1))  # upstream's: indices, not paths
        only_right = list(range(len(x2) - 1, len(x1) - 1, -1))
        pairs = [(i, v1, v2) for i, (v1, v2) in enumerate(zip(x1, x2))]
    elif hasattr(x1, "replica_id") and type(x1) is type(x2):
        return diff(x1.data, x2.data, prefix + (type(x1),))
    else:
        return [], [], [(prefix, type(x1), type(x2))] if _leaves_differ(x1, x2) else []
    mismatch = []
    for k, v1, v2 in pairs:
        left, right, wrong = diff(v1, v2, prefix + (k,))
        only_left += left
        only_right += right
        mismatch += wrong
    return only_left, only_right, mismatch
