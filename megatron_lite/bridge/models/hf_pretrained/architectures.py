"""Which Hugging Face architectures AutoBridge takes and through which wrapper, and the config facts
its export reads (multi-token-prediction layers a model was built without): Megatron-Bridge's
module-level helpers of ``auto_bridge.py``, kept apart from the class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_lite.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM
from megatron_lite.bridge.models.hf_pretrained.masked_lm import PreTrainedMaskedLM
from megatron_lite.bridge.models.hf_pretrained.token_classification import PreTrainedTokenClassification

# Architecture name endings AutoBridge accepts (upstream's list; a bridge must still be registered).
SUPPORTED_HF_ARCHITECTURES: tuple[str, ...] = (
    "ForCausalLM",
    "ForConditionalGeneration",
    "NemotronH_Nano_VL_V2",
    "NemotronH_Nano_Omni_Reasoning_V3",
    "NemotronH_Super_Omni_Reasoning_V3",
    "Qwen2_5OmniModel",
    "NemotronLabsDiffusionModel",
    "LLaDAModelLM",
    "ForMaskedLM",
    "ForTokenClassification",
    "GPT2LMHeadModel",  # megatron_lite's GPT-2 bridge: transformers names its causal LM so
)
SUPPORTED_HF_ARCHITECTURES_DISPLAY = " or ".join(f"'{s}'" for s in SUPPORTED_HF_ARCHITECTURES)
HF_ARCHITECTURE_ALIASES: dict[str, str] = {"Qwen2_5OmniModel": "Qwen2_5OmniForConditionalGeneration"}
PRETRAINED_WRAPPER_TYPES = (PreTrainedCausalLM, PreTrainedMaskedLM, PreTrainedTokenClassification)
MTP_CONFIG_FIELDS: tuple[str, ...] = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_num_layers")
_MISSING = object()


def _resolve_pretrained_wrapper_cls(config: Any) -> type:
    """The wrapper a config's architectures load through: token classification, masked LM, or causal."""
    architectures = getattr(config, "architectures", None) or []
    if any(arch.endswith("ForTokenClassification") for arch in architectures):
        return PreTrainedTokenClassification
    if any(arch.endswith("ForMaskedLM") for arch in architectures):
        return PreTrainedMaskedLM
    return PreTrainedCausalLM


def _drop_readonly_config_properties(config_dict: dict, config_type: type) -> dict:
    """``config_dict`` without the names ``config_type`` has as read-only properties (a config
    cannot be built with them)."""
    readonly = {
        name
        for cls in config_type.mro()
        for name, attr in vars(cls).items()
        if isinstance(attr, property) and attr.fset is None
    }
    return {k: v for k, v in config_dict.items() if k not in readonly}


def _get_config_field(config: Any, field: str) -> Any:
    """A field the config itself set (a dict's key or an instance attribute; not a class default)."""
    if isinstance(config, dict):
        return config.get(field, _MISSING)
    return getattr(config, "__dict__", {}).get(field, _MISSING)


def _config_disables_mtp(config: Any) -> bool:
    """True when the config (or its ``text_config``) sets its MTP layer count to 0."""
    if config is None:
        return False
    for field in MTP_CONFIG_FIELDS:
        value = _get_config_field(config, field)
        if value is not _MISSING and value is not None:
            return int(value) == 0
    text_config = _get_config_field(config, "text_config")
    return text_config is not _MISSING and _config_disables_mtp(text_config)


def _saved_config_disables_mtp(path: str | Path) -> bool:
    """``_config_disables_mtp`` of the config.json written into ``path`` (False when none)."""
    config_path = Path(path) / "config.json"
    if not config_path.exists():
        return False
    with open(config_path) as f:
        return _config_disables_mtp(json.load(f))


def _model_omits_mtp(model_config: Any) -> bool:
    """True when the built model has no MTP head: its config sets ``mtp_num_layers`` falsy."""
    if model_config is None:
        return False
    value = _get_config_field(model_config, "mtp_num_layers")
    return value is not _MISSING and not value


def _num_hidden_layers(configs) -> int | None:
    for config in configs:
        value = _get_config_field(config, "num_hidden_layers")
        if value is _MISSING or value is None:
            text_config = _get_config_field(config, "text_config")
            if text_config is not _MISSING:
                value = _get_config_field(text_config, "num_hidden_layers")
        if value is not _MISSING and value is not None:
            return int(value)
    return None


def _mtp_source_key_prefixes(source: Any, *configs: Any) -> tuple[str, ...]:
    """The source checkpoint's key prefixes holding MTP tensors (``mtp.``, or the layers stored after
    the last decoder layer as GLM / Step do), for an export of a model built without them: their
    files could never be completed otherwise. Only those present in ``source`` are returned."""
    prefixes = ["mtp."] if source.has_glob("mtp.*") else []
    layers = _num_hidden_layers(configs)
    if layers is not None:
        count = 1
        for config in configs:
            text_config = _get_config_field(config, "text_config")
            for candidate in (config,) if text_config is _MISSING else (config, text_config):
                for field in MTP_CONFIG_FIELDS:
                    value = _get_config_field(candidate, field)
                    if value is not _MISSING and value is not None:
                        count = max(count, int(value))
        for index in range(layers, layers + count):
            if source.has_glob(f"model.layers.{index}.*"):
                prefixes.append(f"model.layers.{index}.")
    return tuple(prefixes)
