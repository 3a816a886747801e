"""MegatronMappingRegistry: a family's mappings, looked up by megatron parameter name."""

from __future__ import annotations

import re

from megatron_lite.bridge.models.conversion.param_mapping import MegatronParamMapping
from megatron_lite.core.transformer.moe.moe_layer import moe_layer_pattern

# Which layers a mapping's megatron name belongs to: a MoE layer's, a dense layer's, or either.
_MOE_PARTS = (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts.")
_DENSE_PARTS = (".mlp.linear_fc1.", ".mlp.linear_fc2.")


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(r"\*", r"(\d+)") + "$")


def _layer_kind(megatron_name: str) -> int | None:
    """1 for a MoE layer's parameter, 0 for a dense MLP's, None for every layer's."""
    if any(part in megatron_name for part in _MOE_PARTS):
        return 1
    if any(part in megatron_name for part in _DENSE_PARTS):
        return 0
    return None


class MegatronMappingRegistry:
    """Mappings by megatron name; the first ``*`` stands for a layer number (the whole model's,
    0-based), a second one for a global expert index."""

    def __init__(self, *mappings: MegatronParamMapping):
        self.mappings = list(mappings)
        self._patterns = [(_pattern(m.megatron_param), m) for m in self.mappings]

    def megatron_to_hf_lookup(self, megatron_name: str) -> MegatronParamMapping | None:
        """The mapping of one megatron parameter (its layer number and expert filled in), or None."""
        for pattern, mapping in self._patterns:
            match = pattern.match(megatron_name)
            if match:
                return mapping.resolve(match.groups())
        return None

    def hf_names(self, config) -> set[str]:
        """Every Hugging Face tensor name the mappings read for a model of ``config``: a MoE layer's
        router and experts (each of ``num_moe_experts``) where moe_layer_pattern says 1, the dense
        MLP where it says 0."""
        pattern = moe_layer_pattern(config)
        names = set()
        for mapping in self.mappings:
            wildcards = mapping.megatron_param.count("*")
            if not wildcards:
                names.update(mapping.hf_param_names)
                continue
            kind = _layer_kind(mapping.megatron_param)
            for layer in range(config.num_layers):
                if kind is not None and pattern[layer] != kind:
                    continue
                experts = range(config.num_moe_experts) if wildcards > 1 else [None]
                for expert in experts:
                    indices = [str(layer)] + ([] if expert is None else [str(expert)])
                    names.update(mapping.resolve(tuple(indices)).hf_param_names)
        return names
