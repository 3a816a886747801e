"""BridgeGPTModelConfig (Megatron-Bridge's ``megatron.bridge.models.gpt.model_config``): a GPT's build
fields beside its nested ``transformer`` config, as upstream's builder-backed configs split them.

The build fields are GPTModelProvider's own (those TransformerConfig lacks, or where it sets another
default), with its defaults: one list of fields, so the two configs of one Hugging Face model agree.
A transformer field is read through the outer config (``config.hidden_size``), as upstream's."""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, make_dataclass

from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.models.gpt_provider import GPTModelProvider


@dataclass(kw_only=True)
class _NestedTransformer:
    transformer: TransformerConfig

    def __getattr__(self, name: str):
        # Reached only for names the outer config lacks: the transformer's fields.
        if name.startswith("__") or "transformer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["transformer"], name)


def _build_fields() -> list[tuple]:
    transformer = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    spec = []
    for f in dataclasses.fields(GPTModelProvider):
        base = transformer.get(f.name)
        if base is not None and (base.default, base.default_factory) == (f.default, f.default_factory):
            continue
        if f.default_factory is not MISSING:
            default = dataclasses.field(default_factory=f.default_factory)
        else:
            default = dataclasses.field(default=f.default)
        spec.append((f.name, f.type, default))
    # Upstream's builder picks the layer spec: none here (the provider holds a function).
    return [*spec, ("transformer_layer_spec", object, dataclasses.field(default=None))]


BridgeGPTModelConfig = make_dataclass(
    "BridgeGPTModelConfig",
    _build_fields(),
    bases=(_NestedTransformer,),
    kw_only=True,
    namespace={"__doc__": "A GPT's build fields and its nested ``transformer`` (TransformerConfig)."},
)
BridgeGPTModelConfig.__module__ = __name__

__all__ = ["BridgeGPTModelConfig"]
