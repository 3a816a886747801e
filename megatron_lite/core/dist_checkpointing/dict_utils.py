"""Walking nested state dicts (megatron-core's ``dist_checkpointing.dict_utils``): dicts and lists are
the branches, anything else a leaf."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
