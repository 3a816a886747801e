"""Reading values that transformers moved between versions (Megatron-Bridge's ``transformers_compat``):
before 5.0 a config has ``rope_theta``; from 5.0 it sits in the ``rope_parameters`` dict."""

from __future__ import annotations


def _theta_in(parameters) -> float | None:
    """The rotary base in a ``rope_parameters`` dict: flat, or per attention kind (Gemma3's layout)."""
    if not isinstance(parameters, dict):
        return None
    if parameters.get("rope_theta") is not None:
        return parameters["rope_theta"]
    for kind, key in (("global", "base"), ("full_attention", "rope_theta")):
        nested = parameters.get(kind)
        if isinstance(nested, dict) and nested.get(key) is not None:
            return nested[key]
    return None


def rope_theta_from_hf(config) -> float:
    """The rotary base of a Hugging Face config (an object, as transformers' configs are). ValueError
    when the config names none."""
    theta = getattr(config, "rope_theta", None)
    if theta is not None:
        return theta
    theta = _theta_in(getattr(config, "rope_parameters", None))
    if theta is not None:
        return theta
    default = getattr(config, "default_theta", None)
    if isinstance(default, (int, float)) and not isinstance(default, bool) and default:
        return float(default)
    if isinstance(default, dict) and default.get("global") is not None:
        return default["global"]
    raise ValueError("the config names no rotary base (rope_theta or rope_parameters['rope_theta'])")
