"""Reading a Hugging Face config.json as plain JSON (no ``transformers`` at run time, no code run):
each family's class defaults stand in for keys ``save_pretrained`` left out."""

from __future__ import annotations

import json
import os

from megatron_lite.bridge.models.conversion.errors import BridgeError

# Families megatron_lite does not build, and the config.json field that says why.
UNSUPPORTED = {
    "qwen3_moe": "num_experts (mixture of experts)",
    "deepseek_v3": "n_routed_experts (mixture of experts)",
    "qwen3": "q_norm / k_norm (QK layernorm)",
    "gemma": "hidden_activation (GeGLU) and the (1 + weight) RMSNorm",
    "gemma2": "attn_logit_softcapping",
    "phi3": "qkv_proj (fused query-key-value weights)",
}


def read_config(path: str) -> dict:
    """config.json of a model directory as a dict."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise BridgeError(f"{path}: not a directory (a local Hugging Face model directory is needed)")
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise BridgeError(f"{path}: has no config.json") from None
    except (OSError, ValueError) as err:
        raise BridgeError(f"{file}: unreadable ({type(err).__name__})") from None
    if not isinstance(config, dict):
        raise BridgeError(f"{file}: not a JSON object")
    model_type = config.get("model_type")
    if model_type in UNSUPPORTED:
        raise BridgeError(
            f"{file}: {UNSUPPORTED[model_type]} of model_type {model_type!r} is not supported by megatron_lite"
        )
    return config


class HFConfig:
    """A Hugging Face config's values with the family's defaults, read as config.json's keys
    (``cfg["hidden_size"]``, ``cfg.get(...)``) or as a transformers config's attributes
    (``cfg.hidden_size``, what Megatron-Bridge's mappings read). ``values`` is config.json's dict or a
    config object (a transformers ``PretrainedConfig``)."""

    def __init__(self, values, defaults: dict | None = None, path: str = "config.json"):
        if isinstance(values, HFConfig):
            values = values.values
        self.values, self.defaults, self.path = values, defaults or {}, path

    def _lookup(self, key: str):
        """(found, value): the config's own value, else the family default."""
        if isinstance(self.values, dict):
            if key in self.values:
                return True, self.values[key]
        elif hasattr(self.values, key):
            return True, getattr(self.values, key)
        if key in self.defaults:
            return True, self.defaults[key]
        return False, None

    def __getitem__(self, key: str):
        value = self._lookup(key)[1]
        if value is not None:
            return value
        if key in self.defaults:
            return self.defaults[key]
        raise BridgeError(f"{self.path}: has no {key}")

    def __getattr__(self, key: str):
        if key.startswith("_") or key in ("values", "defaults", "path"):
            raise AttributeError(key)
        found, value = self._lookup(key)
        if not found:
            raise AttributeError(key)
        return value

    def get(self, key: str, default=None):
        value = self._lookup(key)[1]
        return default if value is None else value

    def refuse(self, key: str, why: str) -> BridgeError:
        return BridgeError(f"{self.path}: {key}={self._lookup(key)[1]!r}: {why}")
