"""MegatronMappingRegistry: a family's mappings, looked up by megatron parameter name."""

from __future__ import annotations

import re

from megatron_lite.bridge.models.conversion.param_mapping import MegatronParamMapping


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(r"\*", r"(\d+)") + "$")


class MegatronMappingRegistry:
    """Mappings by megatron name; ``*`` stands for a layer number (the whole model's, 0-based)."""

    def __init__(self, *mappings: MegatronParamMapping):
        self.mappings = list(mappings)
        self._patterns = [(_pattern(m.megatron_param), m) for m in self.mappings]

    def megatron_to_hf_lookup(self, megatron_name: str) -> MegatronParamMapping | None:
        """The mapping of one megatron parameter (its layer number filled in), or None."""
        for pattern, mapping in self._patterns:
            match = pattern.match(megatron_name)
            if match:
                return mapping.resolve(match.group(1) if match.groups() else None)
        return None

    def hf_names(self, num_layers: int) -> set[str]:
        """Every Hugging Face tensor name the mappings read for a model of ``num_layers`` layers."""
        names = set()
        for mapping in self.mappings:
            layers = range(num_layers) if "*" in mapping.megatron_param else [None]
            for layer in layers:
                names.update(mapping.resolve(None if layer is None else str(layer)).hf_params.values())
        return names
