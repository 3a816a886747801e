"""Dict and YAML round trips of a config container, in upstream's ``_target_`` layout.

Every dataclass becomes ``{"_target_": "module.Class", <init fields>...}`` and is rebuilt by calling
that class with those fields, so a saved run config reloads as the same typed sections. Derived
fields (``init=False``, or a leading underscore) are not written: ``finalize()`` / ``__post_init__``
derive them again. Callables that cannot be named (closures such as the default init methods) are
written as None and re-derived the same way. PyYAML is imported only when YAML is asked for (it is
installed with wandb, a dependency of megatron_lite).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T", bound="_ConfigContainerBase")


def _target(obj: Any) -> str:
    """Import path of a class or function, or of an instance's class."""
    named = obj if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__")) else type(obj)
    return f"{named.__module__}.{named.__qualname__}"


def _to_plain(value: Any) -> Any:
    if isinstance(value, _ConfigContainerBase):
        return value.to_dict()
    if is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {"_target_": _target(value)}
        for f in fields(value):
            if f.init and not f.name.startswith("_"):
                out[f.name] = _to_plain(getattr(value, f.name))
        return out
    if isinstance(value, torch.dtype):
        return {"_target_": str(value), "_call_": False}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if callable(value):
        name = getattr(value, "__qualname__", "")
        return (
            None
            if "<locals>" in name or "<lambda>" in name
            else {"_target_": _target(value), "_call_": False}
        )
    return value


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _from_plain(value: Any, strict: bool) -> Any:
    if isinstance(value, list):
        return [_from_plain(v, strict) for v in value]
    if not isinstance(value, dict):
        return value
    if "_target_" not in value:
        return {k: _from_plain(v, strict) for k, v in value.items()}
    target = _resolve(value["_target_"])
    if value.get("_call_", True) is False:
        return target
    kwargs = {k: _from_plain(v, strict) for k, v in value.items() if k not in ("_target_", "_call_")}
    if is_dataclass(target):
        known = {f.name for f in fields(target) if f.init}
        extra = set(kwargs) - known
        if extra and strict:
            raise ValueError(f"{target.__qualname__} has no fields {sorted(extra)}")
        kwargs = {k: v for k, v in kwargs.items() if k in known}
    return target(**kwargs)


class _ConfigContainerBase:
    """Serialisation shared by config containers: to_dict / from_dict / to_yaml / from_yaml."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"_target_": _target(self)}
        for f in fields(self):
            if f.init and not f.name.startswith("_"):
                out[f.name] = _to_plain(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls: type[T], config_dict: dict[str, Any], strict: bool = True) -> T:
        """Rebuild a container from :meth:`to_dict` output; ``strict`` refuses unknown fields."""
        config_dict = copy.deepcopy(config_dict)
        if "_target_" not in config_dict:
            config_dict["_target_"] = _target(cls)
        return _from_plain(config_dict, strict)

    def to_yaml(self, yaml_path: str) -> None:
        yaml = _yaml()
        with open(yaml_path, "w") as f:
            yaml.safe_dump(self.to_dict(), f, default_flow_style=False, sort_keys=False)

    @classmethod
    def from_yaml(cls: type[T], yaml_path: str, strict: bool = False) -> T:
        yaml = _yaml()
        with open(yaml_path) as f:
            return cls.from_dict(yaml.safe_load(f), strict=strict)

    def print_yaml(self) -> None:
        print(_yaml().safe_dump(self.to_dict(), default_flow_style=False, sort_keys=False))


def _yaml():
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - PyYAML comes with wandb
        raise ImportError("YAML configs need PyYAML: pip install pyyaml") from exc
    return yaml
