"""Walking a module tree and replacing modules in place (Megatron-Bridge's ``peft.walk_utils``).

``walk(module, func, **kwargs)`` calls ``func(module, ...)`` on every module, parents first, and sets
what it returns in the parent's place. ``func`` receives those of ``name`` (the attribute or list
index it sits at), ``prefix`` (its parent's dotted path, so ``f"{prefix}.{name}"`` is its
``named_modules()`` name), ``i`` (its position among its siblings) and the caller's ``kwargs`` that
its signature names. Children walked are those of the module *before* ``func`` ran, so a wrapper
``func`` returns (a ``LoRALinear``) is not walked into: its adapter's linears are never matched.
A container (``ModuleList``, ``Sequential``, ``ModuleDict``) is passed to ``func`` too and rebuilt
from its mapped items. A module with a ``map`` method of its own maps itself (unless ``_skip_map``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

from torch import nn

ModuleFunc = Callable[..., nn.Module]

_POSITION = ("i", "name", "prefix")


def _func_kwargs(func: ModuleFunc, kwargs: dict) -> dict:
    """The entries of ``kwargs`` that ``func``'s signature names (Bridge passes only those)."""
    params = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _child_prefix(kwargs: dict) -> str:
    name, prefix = kwargs.get("name", ""), kwargs.get("prefix", "")
    return f"{prefix}.{name}" if prefix else (name or "")


def _without_position(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in _POSITION}


def _map_module(module, func, *, leaf_only, seen, **kwargs):
    if id(module) in seen:  # a module shared by two parents is transformed once
        return module
    new_module = module
    if not leaf_only or list(module.parameters(recurse=False)):
        new_module = func(module, **_func_kwargs(func, kwargs))
    prefix, rest = _child_prefix(kwargs), _without_position(kwargs)
    for i, (name, child) in enumerate(list(module.named_children())):
        mapped = map(child, func, leaf_only=leaf_only, _seen=seen, i=i, name=name, prefix=prefix, **rest)
        if new_module is module or mapped is not child:
            setattr(new_module, name, mapped)
    seen.add(id(new_module))
    return new_module


def _map_list(container, func, *, leaf_only, seen, **kwargs):
    if not leaf_only:
        container = func(container, **_func_kwargs(func, kwargs))
    prefix, rest = _child_prefix(kwargs), _without_position(kwargs)
    items = [
        map(m, func, leaf_only=leaf_only, _seen=seen, i=i, name=str(i), prefix=prefix, **rest)
        for i, m in enumerate(container)
    ]
    if all(new is old for new, old in zip(items, container)):
        return container  # nothing replaced: keep the container (and any attribute it carries)
    # Rebuilt as the same container type (Sequential takes its modules as arguments).
    if "args" in inspect.signature(type(container).__init__).parameters:
        return type(container)(*items)
    return type(container)(items)


def _map_dict(container, func, *, leaf_only, seen, **kwargs):
    if not leaf_only:
        container = func(container, **_func_kwargs(func, kwargs))
    prefix, rest = _child_prefix(kwargs), _without_position(kwargs)
    items = {
        name: map(m, func, leaf_only=leaf_only, _seen=seen, i=i, name=name, prefix=prefix, **rest)
        for i, (name, m) in enumerate(container.items())
    }
    if all(items[name] is m for name, m in container.items()):
        return container
    return type(container)(items)


# Bridge's name, shadowing the builtin inside this module on purpose.
def map(module: nn.Module, func: ModuleFunc, leaf_only: bool = False, **kwargs) -> nn.Module:  # noqa: A001
    """Apply ``func`` to ``module`` and its descendants (as ``walk``); returns the (possibly
    replaced) module. ``leaf_only``: only modules holding parameters of their own."""
    seen = kwargs.pop("_seen", None)
    seen = set() if seen is None else seen
    if not kwargs.pop("_skip_map", False) and callable(getattr(module, "map", None)):
        return module.map(func, leaf_only=leaf_only, **kwargs)
    if isinstance(module, Iterable):
        if all(hasattr(module, key) for key in ("items", "values", "keys")):
            return _map_dict(module, func, leaf_only=leaf_only, seen=seen, **kwargs)
        return _map_list(module, func, leaf_only=leaf_only, seen=seen, **kwargs)
    return _map_module(module, func, leaf_only=leaf_only, seen=seen, **kwargs)


def walk(module: nn.Module, func: ModuleFunc, leaf_only: bool = False, **kwargs) -> nn.Module:
    """Apply ``func`` to ``module`` and, recursively, to all its descendants; returns the (possibly
    replaced) root. Extra ``kwargs`` reach ``func`` where its signature names them."""
    return map(module, func, leaf_only=leaf_only, **kwargs)


def forall(module: nn.Module, func: Callable[[nn.Module], object], recurse: bool = False) -> bool:
    """Whether ``func`` holds for ``module`` (and every descendant when ``recurse``)."""
    modules = module.modules() if recurse else [module]
    return all(bool(func(m)) for m in modules)
