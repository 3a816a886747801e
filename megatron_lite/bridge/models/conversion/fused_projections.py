"""Megatron parameters that fuse several Hugging Face projections: ``linear_qkv`` (q, k, v),
``linear_kv`` (k, v) and a gated ``linear_fc1`` (gate, up), and a MoE layer's routed experts built
from them. param_mapping.py serves them under Megatron-Bridge's names.

On load a TP rank holds whole query groups (qkv_layout.py's group-major rows) or its block of the gate
rows, then the same block of the up rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_lite.bridge.models.conversion import qkv_layout
from megatron_lite.bridge.models.conversion.parallel_mappings import AutoMapping
from megatron_lite.bridge.models.conversion.param_mapping_base import MegatronParamMapping, _tp_range


def _layout(config) -> SimpleNamespace:
    """The attention sizes the qkv helpers read: picklable, to send between PP ranks."""
    fields = ("num_attention_heads", "num_query_groups", "kv_channels", "hidden_size")
    return SimpleNamespace(**{f: getattr(config, f) for f in fields})


class _AttentionMapping(MegatronParamMapping):
    """q / k / v (or k / v) merged per query group; TP splits the merged rows as a column-parallel."""

    _merge, _split = staticmethod(qkv_layout.merge_qkv_weights), staticmethod(qkv_layout.split_qkv_weights)

    def __init__(self, megatron_param: str, **roles: str):
        super().__init__(megatron_param, roles)
        self._tp_mapping = AutoMapping(megatron_param, megatron_param)

    def hf_to_megatron(self, hf_weights, megatron_module):
        merged = None
        if self.tp_rank == 0:
            merged = self._merge(self._get_config(megatron_module), *(hf_weights[r] for r in self.hf_param))
        return self._tp_mapping.hf_to_megatron(merged, megatron_module)

    def megatron_to_hf(self, megatron_weights, megatron_module):
        config = _layout(self._get_config(megatron_module)) if megatron_module is not None else None
        config = self.broadcast_obj_from_pp_rank(config, "qkv_config")
        packed = self._tp_mapping.megatron_to_hf(megatron_weights, megatron_module)
        if not packed:
            return {}
        return self.full_to_hf(next(iter(packed.values())), config)

    def read_shard(self, read, shape, tp_rank, tp_size, config):
        d, groups = qkv_layout.head_dim(config), config.num_query_groups
        first, last = _tp_range(groups, tp_rank, tp_size)
        rows = {"q": config.num_attention_heads // groups * d, "k": d, "v": d}
        parts = [read(name, 0, first * rows[r], last * rows[r]) for r, name in self.hf_param.items()]
        return qkv_layout.interleave_groups(parts, last - first)

    def full_to_hf(self, full, config):
        return {name: t.contiguous() for name, t in zip(self.hf_param.values(), self._split(config, full))}


class QKVMapping(_AttentionMapping):
    """``linear_qkv`` from separate q, k, v projections (weights or biases)."""

    def __init__(self, megatron_param: str, q: str, k: str, v: str):
        super().__init__(megatron_param, q=q, k=k, v=v)


class KVMapping(_AttentionMapping):
    """``linear_kv`` from separate k, v projections (weights or biases)."""

    _merge, _split = staticmethod(qkv_layout.merge_kv_weights), staticmethod(qkv_layout.split_kv_weights)

    def __init__(self, megatron_param: str, k: str, v: str):
        super().__init__(megatron_param, k=k, v=v)


class GatedMLPMapping(MegatronParamMapping):
    """A gated ``linear_fc1`` = ``[gate; up]``; each TP rank holds its slice of both, gate first."""

    def __init__(self, megatron_param: str, gate: str, up: str):
        super().__init__(megatron_param, {"gate": gate, "up": up})

    def hf_to_megatron(self, hf_weights, megatron_module):
        gate, up = hf_weights["gate"], hf_weights["up"]
        if self.tp_size == 1:
            return torch.cat((gate, up))
        target = self._target_param(megatron_module)
        splits = None
        if self.tp_rank == 0:
            if gate.shape[0] % self.tp_size:
                raise ValueError(
                    f"Cannot evenly split gate dimension 0 size {gate.shape[0]} across {self.tp_size} TP ranks"
                )
            pairs = zip(gate.chunk(self.tp_size), up.chunk(self.tp_size))
            splits = [torch.cat(pair) for pair in pairs]
        return self.scatter_to_tp_ranks(splits, target.shape, target.dtype, target.device)

    def megatron_to_hf(self, megatron_weights, megatron_module):
        megatron_weights = self.broadcast_from_pp_rank(megatron_weights, cache_key=str(self.hf_param))
        if megatron_weights is None:
            return {}
        halves = [shard.chunk(2) for shard in self.gather_from_tp_ranks(megatron_weights)]
        gate, up = torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])
        return {self.hf_param["gate"]: gate, self.hf_param["up"]: up}

    def read_shard(self, read, shape, tp_rank, tp_size, config):
        rows = _tp_range(shape[0] // 2 * tp_size, tp_rank, tp_size)
        return torch.cat((read(self.hf_param["gate"], 0, *rows), read(self.hf_param["up"], 0, *rows)))

    def full_to_hf(self, full, config):
        gate, up = full.chunk(2, dim=0)
        return {self.hf_param["gate"]: gate.contiguous(), self.hf_param["up"]: up.contiguous()}


def routed_expert_mappings(
    layer: str, experts: str, gate: str, up: str, down: str
) -> list[MegatronParamMapping]:
    """A MoE layer's routed experts, grouped (``linear_fc1.weight<e>``, ``--moe-grouped-gemm``) and
    sequential (``local_experts.<e>.``), from Hugging Face's per-expert projections
    ``{experts}<e>.{gate|up|down}.weight``; ``<e>`` is the global expert index on both sides."""
    hf = lambda name: f"{experts}*.{name}.weight"  # noqa: E731
    prefix = layer + "mlp.experts."
    return [
        GatedMLPMapping(prefix + "linear_fc1.weight*", hf(gate), hf(up)),
        AutoMapping(prefix + "linear_fc2.weight*", hf(down)),
        GatedMLPMapping(prefix + "local_experts.*.linear_fc1.weight", hf(gate), hf(up)),
        AutoMapping(prefix + "local_experts.*.linear_fc2.weight", hf(down)),
    ]
