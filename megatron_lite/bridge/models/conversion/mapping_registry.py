"""MegatronMappingRegistry: a family's mappings, looked up by megatron or Hugging Face parameter name.

Megatron-Bridge's registry (same constructor, lookups and wildcards), plus ``hf_names``: every Hugging
Face tensor a model of a given config reads, which the bridge checks a checkpoint against.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from megatron_lite.bridge.models.conversion.param_mapping import AutoMapping, MegatronParamMapping
from megatron_lite.core.transformer.moe.moe_layer import moe_layer_pattern

# Which layers a mapping's megatron name belongs to: a MoE layer's, a dense layer's, or either.
_MOE_PARTS = (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts.")
_DENSE_PARTS = (".mlp.linear_fc1.", ".mlp.linear_fc2.")

# A norm fused into the next linear (Transformer Engine's layer_norm_weight) and the same norm as a module
# of its own: a mapping of the first also answers for the second, as upstream's registry adds.
_SEPARATE_LAYERNORM_NAMES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
    ("self_attention.linear_q_up_proj.layer_norm_bias", "self_attention.q_layernorm.bias"),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.layer_norm_bias", "self_attention.kv_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    ("mixer.in_proj.layer_norm_weight", "norm.weight"),
)


def _pattern(name: str, any_text: bool = False) -> re.Pattern | None:
    """``name`` as an anchored regex: ``**`` captures any text, ``*`` digits (a layer or expert number);
    with ``any_text`` both match anything, uncaptured (a search). None for a name without wildcards."""
    if "*" not in name and not any_text:
        return None
    one = ".*" if any_text else r"(\d+)"
    many = ".*" if any_text else "(.*)"
    return re.compile("^" + re.escape(name).replace(r"\*\*", many).replace(r"\*", one) + "$")


def _layer_kind(megatron_name: str) -> int | None:
    """1 for a MoE layer's parameter, 0 for a dense MLP's, None for every layer's."""
    if any(part in megatron_name for part in _MOE_PARTS):
        return 1
    if any(part in megatron_name for part in _DENSE_PARTS):
        return 0
    return None


def _separate_layernorm_aliases(mappings: list[MegatronParamMapping]) -> list[MegatronParamMapping]:
    """An AutoMapping under the separate norm's name for each fused-norm mapping without one."""
    names = {m.megatron_param for m in mappings}
    aliases = []
    for mapping in mappings:
        for fused, separate in _SEPARATE_LAYERNORM_NAMES:
            if not mapping.megatron_param.endswith(f"*.{fused}"):
                continue
            alias = mapping.megatron_param[: -len(fused)] + separate
            # Only AutoMapping has a known way to copy itself; other kinds keep their one name.
            if alias not in names and isinstance(mapping, AutoMapping):
                aliases.append(AutoMapping(alias, mapping.hf_param, mapping.permute_dims))
                names.add(alias)
            break
    return aliases


class MegatronMappingRegistry:
    """Mappings looked up by either side's name, first match winning. In names, ``*`` stands for digits
    (a layer number, the whole model's and 0-based, then a global expert index), ``**`` for any text;
    a lookup returns the mapping with its wildcards filled from the name asked for."""

    def __init__(self, *mappings: MegatronParamMapping):
        self.mappings = list(mappings)
        self.mappings += _separate_layernorm_aliases(self.mappings)
        self._megatron_patterns = [(_pattern(m.megatron_param), m) for m in self.mappings]
        # Per mapping: (role or None, pattern or None) for each of its Hugging Face names.
        self._hf_patterns = [
            (
                [(None, _pattern(m.hf_param))]
                if isinstance(m.hf_param, str)
                else [(role, _pattern(name)) for role, name in m.hf_param.items()]
            )
            for m in self.mappings
        ]

    def megatron_to_hf_lookup(self, megatron_param_name: str) -> MegatronParamMapping | None:
        """The mapping of one megatron parameter (its wildcards filled in), or None."""
        for pattern, mapping in self._megatron_patterns:
            if pattern is None:
                if mapping.megatron_param == megatron_param_name:
                    return mapping
                continue
            match = pattern.match(megatron_param_name)
            if match:
                return mapping.resolve(match.groups())
        return None

    def hf_to_megatron_lookup(self, hf_param_name: str) -> MegatronParamMapping | None:
        """The mapping that reads one Hugging Face tensor (its wildcards filled in), or None."""
        for mapping, patterns in zip(self.mappings, self._hf_patterns, strict=True):
            for role, pattern in patterns:
                if pattern is None:
                    name = mapping.hf_param if role is None else mapping.hf_param[role]
                    if name == hf_param_name:
                        # A name by role comes back as a copy, as upstream's does.
                        return mapping if role is None else mapping.resolve(())
                    continue
                match = pattern.match(hf_param_name)
                if match:
                    return mapping.resolve(match.groups())
        return None

    def get_all_mappings(self) -> list[MegatronParamMapping]:
        """Every mapping, in a list of the caller's own."""
        return list(self.mappings)

    def get_mappings_by_pattern(self, pattern: str) -> list[MegatronParamMapping]:
        """The mappings whose megatron name matches ``pattern``, where ``*`` and ``**`` match anything
        (a wildcard in a mapping's name included)."""
        search = _pattern(pattern, any_text=True)
        return [m for m in self.mappings if search.match(m.megatron_param)]

    def __len__(self) -> int:
        return len(self.mappings)

    def __iter__(self) -> Iterator[MegatronParamMapping]:
        return iter(self.mappings)

    def __repr__(self) -> str:
        return f"MegatronMappingRegistry({len(self.mappings)} mappings)"

    def describe(self) -> str:
        """Every mapping, numbered: its megatron name, its Hugging Face name(s), its kind."""
        lines = [f"MegatronMappingRegistry with {len(self.mappings)} mappings:"]
        for number, mapping in enumerate(self.mappings, start=1):
            lines.append(f"\n{number}. {mapping.megatron_param}")
            if isinstance(mapping.hf_param, str):
                lines.append(f"   → {mapping.hf_param}")
            else:
                roles = [f"       {role}: {name}" for role, name in mapping.hf_param.items()]
                lines += ["   → {", *roles, "     }"]
            lines.append(f"   bridge: {type(mapping).__name__}")
        return "\n".join(lines)

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
