"""``section.field=value`` overrides on a ConfigContainer, Megatron-Bridge's (Hydra-style) syntax.

``model.tensor_model_parallel_size=2`` sets a field (nested ``a.b.c=`` reaches sections within
sections); ``+env_vars.NAME=1`` adds a key to a dict field; ``~key`` removes a dict key or sets an
optional field to None. The value is read as one YAML scalar or flow collection (``2``, ``1e-4``,
``true``, ``null``, ``[1, 2]``) and converted to the field's declared type: int, float, bool, str,
None, lists, dicts, ``Literal`` choices and torch dtypes (``torch.bfloat16`` or ``bfloat16``).
A key that names nothing, or a value the field cannot take, is a ConfigError naming the key and
what it expects: one line, before anything runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from functools import cache
from typing import Any, Literal, Union

import torch

from megatron_lite.training.errors import ConfigError


def _fields(obj) -> dict[str, dataclasses.Field]:
    # Only what a user may set: init fields without a leading underscore (derived ones are not).
    return {f.name: f for f in dataclasses.fields(obj) if f.init and not f.name.startswith("_")}


@cache
def _hints(cls: type) -> dict[str, Any]:
    """The class's resolved annotations; unresolvable ones stay None (the value's type is used)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation naming a type-checking-only import
        out = {}
        for klass in reversed(cls.__mro__):
            for name in getattr(klass, "__annotations__", {}):
                try:
                    out[name] = typing.get_type_hints(klass).get(name)
                except Exception:
                    out[name] = None
        return out


def _type_name(tp) -> str:
    if tp is None or tp is type(None):
        return "None"
    if isinstance(tp, type):
        return "torch dtype (e.g. torch.bfloat16)" if tp is torch.dtype else tp.__name__
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return str(tp).replace("typing.", "")


class _Mismatch(Exception):
    pass


def _convert(value: Any, tp: Any) -> Any:
    """``value`` (parsed YAML) as type ``tp``, or _Mismatch."""
    if tp is None or tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:  # the first that takes the value as it is wins, then any that converts
            if arg is not type(None) and _exact(value, arg):
                return _convert(value, arg)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        if value in args:
            return value
        raise _Mismatch
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        item = args[0] if args and origin is not tuple else None
        converted = [_convert(v, item) for v in value]
        return tuple(converted) if origin is tuple or tp is tuple else converted
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        item = args[1] if len(args) == 2 else None
        return {k: _convert(v, item) for k, v in value.items()}
    if tp is torch.dtype:
        name = value.removeprefix("torch.") if isinstance(value, str) else None
        dtype = getattr(torch, name, None) if name else None
        if isinstance(dtype, torch.dtype):
            return dtype
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _Mismatch  # a section (dataclass), a callable, or another class: not a scalar


def _exact(value: Any, tp: Any) -> bool:
    """Whether ``value`` already is a ``tp`` (so a union prefers int to float for 2)."""
    if value is None:
        return tp is type(None)
    plain = typing.get_origin(tp) or tp
    if plain is bool or isinstance(value, bool):
        return plain is bool and isinstance(value, bool)
    return isinstance(plain, type) and isinstance(value, plain)


def parse_value(text: str) -> Any:
    """One override's value, read as YAML (safe loader: plain data only)."""
    import yaml

    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text  # e.g. an unbalanced bracket: the literal text, which the type check judges


def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _step(obj: Any, name: str, key: str) -> Any:
    """The field or dict entry ``name`` of ``obj`` (ConfigError naming ``key`` when absent)."""
    if isinstance(obj, dict):
        if name not in obj:
            raise ConfigError(key, f"no key {name!r} in this dict{_suggest(name, obj)}")
        return obj[name]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        known = _fields(obj)
        if name not in known:
            raise ConfigError(key, f"{type(obj).__name__} has no field {name!r}{_suggest(name, known)}")
        return getattr(obj, name)
    shown = "None" if obj is None else f"a {type(obj).__name__}"
    raise ConfigError(key, f"cannot reach {name!r}: the value before it is {shown}, not a section")


def _resolve_section(obj: Any, name: str) -> Any:
    """A section set by name that an override reaches into: a mixed-precision recipe's name becomes
    its config, so ``mixed_precision.grad_reduce_in_fp32=false`` works on ``"bf16_mixed"``."""
    value = getattr(obj, name)
    if name == "mixed_precision" and isinstance(value, str):
        from megatron_lite.training.config.mixed_precision import get_mixed_precision_config

        value = get_mixed_precision_config(value)
        setattr(obj, name, value)
    return value


def _parent(config, parts: list[str], key: str):
    """The section or dict that holds the last part of a dotted key."""
    parent = config
    for i, name in enumerate(parts[:-1]):
        sub = key if i == len(parts) - 2 else ".".join(parts[: i + 1])
        _step(parent, name, sub)
        parent = parent[name] if isinstance(parent, dict) else _resolve_section(parent, name)
    return parent


def _split_key(key: str, shown: str) -> list[str]:
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(shown, "expected section.field=value (a dotted key)")
    return parts


def set_field(config, key: str, value: Any, op: str = "", raw: str | None = None) -> None:
    """Set the field (or dict key) ``key`` of ``config`` to ``value`` (already parsed), converted to
    the field's declared type; ``op`` is ``"+"`` (add a dict key) or ``"~"`` (remove)."""
    parts = _split_key(key, key)
    parent = _parent(config, parts, key)
    last = parts[-1]
    if isinstance(parent, dict):
        _set_dict(parent, last, op, value, key)
        return
    current = _step(parent, last, key)
    if op == "+":
        raise ConfigError(key, "exists already: '+' adds a dict key; set a field with key=value")
    tp = _hints(type(parent)).get(last)
    if op == "~":
        if tp is not None and not _allows_none(tp):
            raise ConfigError(key, f"cannot be removed: it expects {_type_name(tp)}")
        setattr(parent, last, None)
        return
    if tp is None and current is not None:
        tp = type(current)
    try:
        setattr(parent, last, _convert(value, tp))
    except _Mismatch:
        shown = raw.strip() if raw is not None else value
        raise ConfigError(key, f"expects {_type_name(tp)}, got {shown!r}") from None


def apply_override(config, override: str) -> None:
    """Apply one ``key=value`` / ``+key=value`` / ``~key`` override to ``config`` in place."""
    text = override.strip()
    op = text[0] if text[:1] in ("+", "~") else ""
    key, eq, raw = text[len(op) :].partition("=")
    if op != "~" and not eq:
        raise ConfigError(override, "expected section.field=value")
    set_field(config, key.strip(), parse_value(raw) if eq else None, op, raw)


def apply_mapping(config, mapping: dict, prefix: str = "") -> None:
    """Apply a nested dict of overrides (a YAML file's ``{model: {tensor_model_parallel_size: 2}}``):
    a dict under a section's name goes into that section, a dict under a dict field is merged into it
    (as OmegaConf merges), any other value sets the field."""
    for name, value in mapping.items():
        key = f"{prefix}{name}"
        parts = _split_key(key, key)
        target = _step(_parent(config, parts, key), parts[-1], key)
        section = dataclasses.is_dataclass(target) or name == "mixed_precision" and isinstance(target, str)
        if isinstance(value, dict) and section and "_target_" not in value:
            if name == "mixed_precision":
                _resolve_section(_parent(config, parts, key), name)
            apply_mapping(config, value, key + ".")
        elif isinstance(value, dict) and isinstance(target, dict):
            for k, v in value.items():
                set_field(config, f"{key}.{k}", v, op="+")
        else:
            set_field(config, key, value)


def _allows_none(tp) -> bool:
    return tp is Any or tp is type(None) or type(None) in typing.get_args(tp)


def _set_dict(d: dict, name: str, op: str, value: Any, key: str) -> None:
    if op == "~":
        if name not in d:
            raise ConfigError(key, f"no key {name!r} to remove{_suggest(name, d)}")
        del d[name]
        return
    if name not in d and op != "+":
        raise ConfigError(key, f"no key {name!r} in this dict{_suggest(name, d)} (add one with +{key}=...)")
    d[name] = value


def apply_overrides(config, overrides: list[str]):
    """Apply ``overrides`` in order (a later one wins) and return ``config``."""
    for override in overrides or []:
        apply_override(config, override)
    return config
