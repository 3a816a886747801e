"""Which bridge reads which Hugging Face model: by architecture (``LlamaForCausalLM``, Megatron-Bridge's
``get_model_bridge``) and by config.json's ``model_type`` (what megatron_lite's AutoBridge reads)."""

from __future__ import annotations

from megatron_lite.bridge.models.conversion.errors import BridgeError

_BY_MODEL_TYPE: dict[str, type] = {}
_BY_ARCHITECTURE: dict[str, type] = {}


def _name(architecture) -> str:
    return architecture if isinstance(architecture, str) else architecture.__name__


def register(bridge_class: type, source, target=None, provider=None, model_type: str | None = None) -> type:
    """Record ``bridge_class`` for the architecture ``source`` (a class or its name) and ``model_type``,
    and set the class's SOURCE_NAME, MODEL_TYPE and PROVIDER_CLASS from them."""
    if source is not None:
        bridge_class.SOURCE_NAME = _name(source)
        _BY_ARCHITECTURE[bridge_class.SOURCE_NAME] = bridge_class
    if model_type is not None:
        bridge_class.MODEL_TYPE = model_type
        _BY_MODEL_TYPE[model_type] = bridge_class
    if provider is not None:
        bridge_class.PROVIDER_CLASS = provider
    bridge_class.TARGET = target
    return bridge_class


def get_model_bridge(hf_architecture, hf_config=None):
    """A bridge for the Hugging Face architecture (a class or its name); ``hf_config`` (a config or a
    model with one) becomes the bridge's ``hf_config``."""
    name = _name(hf_architecture)
    if name not in _BY_ARCHITECTURE:
        raise BridgeError(
            f"architecture {name!r} is not supported; megatron_lite imports {', '.join(sorted(_BY_ARCHITECTURE))}"
        )
    bridge = _BY_ARCHITECTURE[name]()
    if hf_config is not None:
        bridge.hf_pretrained = hf_config
        bridge.hf_config = hf_config.config if hasattr(hf_config, "config") else hf_config
    return bridge


# Megatron-Bridge's dispatcher keeps its registrations here; its AutoBridge lists them.
get_model_bridge._exact_types = _BY_ARCHITECTURE


def for_model_type(model_type: str | None) -> type:
    if model_type not in _BY_MODEL_TYPE:
        raise BridgeError(
            f"config.json: model_type {model_type!r} is not supported; megatron_lite imports "
            f"{', '.join(sorted(_BY_MODEL_TYPE))}"
        )
    return _BY_MODEL_TYPE[model_type]


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)
