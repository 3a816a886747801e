"""Dict and YAML round trips of a config container, in upstream's ``_target_`` layout.

Every dataclass becomes ``{"_target_": "module.Class", <init fields>...}`` and is rebuilt by calling
that class with those fields, so a saved run config reloads as the same typed sections. Derived
fields (``init=False``, or a leading underscore) are not written: ``finalize()`` / ``__post_init__``
derive them again; so are initialisers left to derive (written as None). A function is written by
name (``{"_target_": "torch.nn.functional.silu", "_call_": false}``), a torch dtype likewise, and an
initialiser with its arguments as Hydra's partial (``{"_target_": ..., "_partial_": true, "sigma":
0.02}``). PyYAML is imported only when YAML is asked for (it is installed with wandb).

Loading is safe: a ``_target_`` is never an arbitrary import. Built (called) targets must be
megatron_lite's own config dataclasses; named targets must be torch dtypes, activation functions
(``torch.nn.functional``, ``megatron_lite.core.activations``, ``torch.tanh`` / ``sigmoid``) or
initialisers (``torch.nn.init``, megatron_lite's normal init). Anything else, e.g. ``os.system``, is
a ConfigError naming the key, and the module it names is not even imported.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

import torch

from megatron_lite.training.errors import ConfigError

T = TypeVar("T", bound="_ConfigContainerBase")

# Packages whose dataclasses a config file may build (the sections and what they hold).
_BUILDABLE_PACKAGES = (
    "megatron_lite.training.config.",
    "megatron_lite.training.tokenizers.config",
    "megatron_lite.models.",
    "megatron_lite.peft.",
    "megatron_lite.data.",
    "megatron_lite.core.",
    "megatron_lite.bridge.models.gpt.",
)


@functools.cache
def _references() -> dict[str, Any]:
    """Every function or dtype a config file may name, by its public name."""
    import torch.nn.functional as F
    import torch.nn.init

    from megatron_lite.core import activations, utils

    table: dict[str, Any] = {
        f"torch.{n}": getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)
    }
    for module, prefix in (
        (F, "torch.nn.functional"),
        (activations, "megatron_lite.core.activations"),
        (torch.nn.init, "torch.nn.init"),
    ):
        for name in dir(module):
            obj = getattr(module, name)
            if not name.startswith("_") and callable(obj) and not isinstance(obj, type):
                if getattr(obj, "__module__", "").startswith(("torch", "megatron_lite")):
                    table[f"{prefix}.{name}"] = obj
    table.update({"torch.tanh": torch.tanh, "torch.sigmoid": torch.sigmoid})
    table["megatron_lite.core.utils._normal_init"] = utils._normal_init
    return table


@functools.cache
def _names() -> dict[int, str]:
    """id(function or dtype) -> the name it is written under (the first public one)."""
    out: dict[int, str] = {}
    for name, obj in _references().items():
        out.setdefault(id(obj), name)
    return out


def _legacy_names() -> dict[str, Any]:
    # Names files written before the table used (e.g. torch._C._nn.gelu): read as the same objects.
    return {_target(obj): obj for obj in _references().values() if not isinstance(obj, torch.dtype)}


def _target(obj: Any) -> str:
    """Import path of a class or function, or of an instance's class."""
    named = obj if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__")) else type(obj)
    return f"{named.__module__}.{named.__qualname__}"


def _derived_default(owner: Any, name: str) -> bool:
    """Whether field ``name`` of ``owner`` is an initialiser left to derive (TransformerConfig's
    init_method fields: a descriptor that keeps an explicit value in its ``slot``)."""
    descriptor = inspect.getattr_static(type(owner), name, None)
    slot = getattr(descriptor, "slot", None)
    return isinstance(slot, str) and owner.__dict__.get(slot) is None


def _to_plain(value: Any) -> Any:
    if isinstance(value, _ConfigContainerBase):
        return value.to_dict()
    if is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {"_target_": _target(value)}
        for f in fields(value):
            if f.init and not f.name.startswith("_"):
                derived = _derived_default(value, f.name)
                out[f.name] = None if derived else _to_plain(getattr(value, f.name))
        return out
    if isinstance(value, torch.dtype):
        return {"_target_": str(value), "_call_": False}
    if isinstance(value, functools.partial):
        name = _names().get(id(value.func))
        if name is None or value.args:
            return None  # not nameable: derived again on load
        return {"_target_": name, "_partial_": True, **{k: _to_plain(v) for k, v in value.keywords.items()}}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if callable(value):
        name = _names().get(id(value))
        if name is None:
            qualname = getattr(value, "__qualname__", "")
            name = None if "<locals>" in qualname or "<lambda>" in qualname else _target(value)
        return None if name is None else {"_target_": name, "_call_": False}
    return value


def _refuse(key: str, path: str, why: str) -> ConfigError:
    return ConfigError(
        key or "_target_",
        f"_target_ {path!r} {why} (a config file may build megatron_lite's config classes and name "
        "torch dtypes, activation and init functions, nothing else)",
    )


def _buildable(path: str, key: str) -> type:
    """The config class ``path`` names, imported only once its package is known to be ours."""
    module, _, name = path.rpartition(".")
    if not (path + ".").startswith(_BUILDABLE_PACKAGES) or not module or not name.isidentifier():
        raise _refuse(key, path, "is not allowed")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _refuse(key, path, "does not exist") from None
    if not (isinstance(cls, type) and is_dataclass(cls)):
        raise _refuse(key, path, "is not a config class")
    return cls


def _reference(path: str, key: str) -> Any:
    found = _references().get(path)
    if found is None:
        found = _legacy_names().get(path)
    if found is None:
        raise _refuse(key, path, "is not allowed")
    return found


def _from_plain(value: Any, strict: bool, key: str = "") -> Any:
    if isinstance(value, list):
        return [_from_plain(v, strict, f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    sub = lambda k: f"{key}.{k}" if key else str(k)  # noqa: E731
    if "_target_" not in value:
        return {k: _from_plain(v, strict, sub(k)) for k, v in value.items()}
    path = value["_target_"]
    if not isinstance(path, str):
        raise _refuse(key, str(path), "is not a name")
    kwargs = {
        k: _from_plain(v, strict, sub(k))
        for k, v in value.items()
        if k not in ("_target_", "_call_", "_partial_")
    }
    if value.get("_partial_") is True:
        return functools.partial(_reference(path, key), **kwargs)
    if value.get("_call_", True) is False:
        return _reference(path, key)
    target = _buildable(path, key)
    known = {f.name for f in fields(target) if f.init}
    extra = sorted(set(kwargs) - known)
    if extra and strict:
        raise ConfigError(sub(extra[0]), f"{target.__qualname__} has no field {extra[0]!r}")
    try:
        return target(**{k: v for k, v in kwargs.items() if k in known})
    except TypeError as err:  # a required field missing, or a value its __init__ refuses
        raise ConfigError(key or target.__qualname__, f"cannot build {target.__qualname__}: {err}") from None


def _check_section_types(container: Any) -> None:
    """Each section is of its declared class (a file may write ``train: 5``): ConfigError naming it."""
    try:
        hints = typing.get_type_hints(type(container))
    except (NameError, TypeError):  # an annotation this interpreter cannot resolve: nothing to check
        return
    for f in fields(container):
        declared = hints.get(f.name)
        options = (
            typing.get_args(declared)
            if typing.get_origin(declared) in (typing.Union, types.UnionType)
            else (declared,)
        )
        classes = tuple(t for t in options if isinstance(t, type))
        if len(classes) != len(options) or not any(is_dataclass(t) for t in classes):
            continue  # not a section (a scalar, a dict, or an annotation not made of classes)
        value = getattr(container, f.name)
        if not isinstance(value, classes):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in classes)
            raise ConfigError(f.name, f"must be a {names} section, got {type(value).__name__}")


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
        """Rebuild a container from :meth:`to_dict` output; ``strict`` refuses unknown fields. Only
        megatron_lite's config classes are built (ConfigError naming the key otherwise)."""
        if not isinstance(config_dict, dict):
            raise ConfigError("config", f"must be a mapping of sections, got {type(config_dict).__name__}")
        config_dict = copy.deepcopy(config_dict)
        if "_target_" not in config_dict:
            config_dict["_target_"] = _target(cls)
        built = _from_plain(config_dict, strict)
        if not isinstance(built, cls):
            raise ConfigError("_target_", f"{config_dict['_target_']!r} is not a {cls.__name__}")
        _check_section_types(built)
        return built

    def to_yaml(self, yaml_path: str) -> None:
        """Write the config as YAML, atomically (a reader never sees half a file)."""
        from megatron_lite.utils.atomic_io import atomic_write_bytes

        data = self.yaml_text().encode()
        atomic_write_bytes(yaml_path, lambda f: f.write(data), needed=len(data))

    def yaml_text(self) -> str:
        """The config as YAML text (what :meth:`to_yaml` writes)."""
        return _yaml().safe_dump(self.to_dict(), default_flow_style=False, sort_keys=False)

    @classmethod
    def from_yaml(cls: type[T], yaml_path: str, strict: bool = False) -> T:
        return cls.from_dict(load_yaml_mapping(yaml_path), strict=strict)

    def print_yaml(self) -> None:
        print(self.yaml_text())


def load_yaml_mapping(yaml_path: str) -> dict[str, Any]:
    """A YAML file's top-level mapping (safe loader: plain data only); a missing file, bad YAML or
    another top-level type is one ConfigError naming the file."""
    yaml = _yaml()
    try:
        with open(yaml_path) as f:
            loaded = yaml.safe_load(f)
    except OSError as err:
        raise ConfigError(str(yaml_path), f"cannot be read ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(str(yaml_path), f"is not valid YAML{line}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(str(yaml_path), f"must hold a mapping, not {type(loaded).__name__}")
    return loaded


def _yaml():
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - PyYAML comes with wandb
        raise ImportError("YAML configs need PyYAML: pip install pyyaml") from exc
    return yaml
