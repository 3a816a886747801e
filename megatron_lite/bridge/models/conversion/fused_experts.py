"""Routed experts stored fused on the Hugging Face side: one tensor ``[num_experts, ...]`` for all of a
layer's experts (newer transformers checkpoints), one megatron parameter per expert. Megatron-Bridge's
``FusedExpertMapping`` / ``FusedGatedExpertMapping``; param_mapping.py serves them under those names.

Import takes this expert's slice and hands it to AutoMapping / GatedMLPMapping for the TP split. Export
gives the expert's tensor under the fused name: Megatron-Bridge's conversion loop stacks the tensors
sharing a ``group_key``; megatron_lite's bridges read and write per-expert tensors and do not use these.
"""

from __future__ import annotations

import re

import torch

from megatron_lite.bridge.models.conversion.fused_projections import GatedMLPMapping
from megatron_lite.bridge.models.conversion.parallel_mappings import AutoMapping

_EXPERT = re.compile(r"(?:weight|bias)(\d+)$|local_experts\.(\d+)\.")


def expert_index(megatron_param: str) -> int:
    """The global expert index in a (resolved) expert parameter's name."""
    match = _EXPERT.search(megatron_param)
    if match is None:
        raise ValueError(f"{megatron_param} names no expert")
    return int(match.group(1) or match.group(2))


class _LooseGatedMLPMapping(GatedMLPMapping):
    is_grouped_export = True  # "<fused>.gate" / "<fused>.up" name no tensor: no wildcard check


class FusedExpertMapping(AutoMapping):
    """One expert's ``linear_fc*`` from the fused ``[num_experts, out, in]`` tensor."""

    is_grouped_export = True

    def __init__(self, megatron_param, hf_param, permute_dims=None, transpose_on_export: bool = False):
        super().__init__(megatron_param, hf_param, permute_dims)
        self.allow_hf_name_mismatch, self.transpose_on_export = True, transpose_on_export

    @property
    def group_key(self) -> str:
        return self.hf_param

    def resolve(self, captures):
        return type(self)(*self._resolve_names(tuple(captures)), self.permute_dims, self.transpose_on_export)

    def hf_to_megatron(self, hf_weights, megatron_module):
        weight = hf_weights[expert_index(self.megatron_param)] if hf_weights.dim() >= 3 else hf_weights
        return super().hf_to_megatron(weight, megatron_module)


class FusedGatedExpertMapping(FusedExpertMapping):
    """One expert's gated ``linear_fc1`` from the fused ``[num_experts, 2 * ffn, hidden]`` gate_up tensor
    (``[num_experts, hidden, 2 * ffn]`` is transposed to it when the module shows the shape)."""

    def __init__(self, megatron_param, hf_param, permute_dims=None, transpose_on_export: bool = False):
        super().__init__(megatron_param, hf_param, permute_dims, transpose_on_export)
        self._gated_mapping = _LooseGatedMLPMapping(self.megatron_param, f"{hf_param}.gate", f"{hf_param}.up")

    def hf_to_megatron(self, hf_weights, megatron_module):
        weight = hf_weights[expert_index(self.megatron_param)] if hf_weights.dim() >= 3 else hf_weights
        if megatron_module is not None and weight.shape[-1] != self._target_param(megatron_module).shape[-1]:
            weight = weight.t()
        gate, up = weight.chunk(2, dim=0)
        return self._gated_mapping.hf_to_megatron({"gate": gate, "up": up}, megatron_module)

    def megatron_to_hf(self, megatron_weights, megatron_module):
        halves = self._gated_mapping.megatron_to_hf(megatron_weights, megatron_module)
        if not halves:
            return {}
        gate, up = halves[f"{self.hf_param}.gate"], halves[f"{self.hf_param}.up"]
        return {self.hf_param: torch.cat((gate, up), dim=0 if gate.dim() == 2 else 1)}
