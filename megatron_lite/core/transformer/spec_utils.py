"""Layer specs (megatron.core.transformer.spec_utils): a ModuleSpec names a module class (or an
importable ``(module path, name)`` pair), the keyword arguments it is built with and its submodules'
specs; ``build_module`` builds one. megatron_lite's layers read the specs they are given to choose
what they build (dense MLP or MoE, sequential or grouped experts): see gpt_layer_specs."""

from __future__ import annotations

import functools
import importlib
import types
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModuleSpec:
    """``module``: a class, a function, or ``(import path, name)``; ``params``: keyword arguments
    added to the builder's; ``submodules``: the specs handed to the module as ``submodules=``."""

    module: tuple | type | types.FunctionType
    params: dict = field(default_factory=dict)
    submodules: object = None
    metainfo: dict = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return build_module(self, *args, **kwargs)


def import_module(module_path: tuple[str, str]):
    """The object ``name`` of module ``base_path`` for ``(base_path, name)``; ImportError if either
    is missing."""
    base_path, name = module_path
    try:
        module = importlib.import_module(base_path)
    except ImportError as exc:
        raise ImportError(f"Could not import module '{base_path}' for spec '{name}': {exc}") from exc
    try:
        return vars(module)[name]
    except KeyError as exc:
        raise ImportError(f"Could not find spec '{name}' in module '{base_path}'") from exc


def get_module(spec_or_module, **additional_kwargs):
    """The class (or function) a spec names, imported if the spec names it by path."""
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    if isinstance(spec_or_module.module, (type, types.FunctionType)):
        return spec_or_module.module
    return import_module(spec_or_module.module)


def build_module(spec_or_module, *args, **kwargs):
    """An instance of what ``spec_or_module`` names, built with ``args``, the spec's ``params`` and
    ``kwargs`` (plus ``submodules=`` when the spec has some). A function, or a spec naming one, is
    returned as it is (bias-dropout-add and other functional pieces are called later)."""
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    if isinstance(spec_or_module, functools.partial):
        return spec_or_module(*args, **kwargs)
    module = get_module(spec_or_module)
    if isinstance(module, types.FunctionType):
        return module
    if getattr(spec_or_module, "submodules", None) is not None:
        kwargs["submodules"] = spec_or_module.submodules
    params = getattr(spec_or_module, "params", None) or {}
    try:
        return module(*args, **params, **kwargs)
    except Exception as e:
        # The module's name is hidden behind the spec: say which one failed.
        raise type(e)(f"{e} when instantiating {module.__name__}").with_traceback(e.__traceback__) from None


def get_submodules(spec) -> object:
    """The ``submodules`` of a ModuleSpec, of a ``functools.partial`` (its ``submodules=`` keyword),
    or of anything else that has them; ValueError otherwise."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    if hasattr(spec, "submodules"):
        return spec.submodules
    raise ValueError(f"Could not find `submodules` in the provided spec: {spec!r}")


def spec_module(spec):
    """The class a spec (ModuleSpec, partial or class) builds, without building it."""
    if isinstance(spec, functools.partial):
        return spec_module(spec.func)
    if isinstance(spec, ModuleSpec):
        return get_module(spec)
    return spec
