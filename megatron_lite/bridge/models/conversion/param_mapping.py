"""Megatron-Bridge's ``param_mapping`` module: how one megatron-core parameter is made of Hugging Face
tensors, every mapping and helper under its upstream name.

The pieces live by concept: the base class (names, wildcards, process groups) in param_mapping_base.py
and its collectives in mapping_communications.py; one tensor split over TP in parallel_mappings.py;
several projections fused into one parameter in fused_projections.py; experts fused on the Hugging
Face side in fused_experts.py; the query-group layout of the
fused attention projections in qkv_layout.py. Parallel state is read through ``mpu`` here, as upstream.
"""

from __future__ import annotations

from megatron_lite.bridge.models.conversion.fused_experts import FusedExpertMapping, FusedGatedExpertMapping
from megatron_lite.bridge.models.conversion.fused_projections import (
    GatedMLPMapping,
    KVMapping,
    QKVMapping,
    routed_expert_mappings,
)
from megatron_lite.bridge.models.conversion.parallel_mappings import (
    AutoMapping,
    ColumnParallelMapping,
    DirectMapping,
    ReplicatedMapping,
    RowParallelMapping,
)
from megatron_lite.bridge.models.conversion.param_mapping_base import MegatronParamMapping, use_parallel_state
from megatron_lite.bridge.models.conversion.qkv_layout import (
    merge_kv_biases,
    merge_kv_weights,
    merge_qkv_biases,
    merge_qkv_weights,
    split_kv_biases,
    split_kv_weights,
    split_qkv_biases,
    split_qkv_weights,
)
from megatron_lite.bridge.models.conversion.utils import get_module_and_param_from_name
from megatron_lite.core import parallel_state as mpu

# Read at each construction, so a stand-in put here (upstream's tests patch ``param_mapping.mpu``) is used.
use_parallel_state(lambda: mpu)

__all__ = [
    "AutoMapping",
    "ColumnParallelMapping",
    "DirectMapping",
    "FusedExpertMapping",
    "FusedGatedExpertMapping",
    "GatedMLPMapping",
    "KVMapping",
    "MegatronParamMapping",
    "QKVMapping",
    "ReplicatedMapping",
    "RowParallelMapping",
    "get_module_and_param_from_name",
    "merge_kv_biases",
    "merge_kv_weights",
    "merge_qkv_biases",
    "merge_qkv_weights",
    "routed_expert_mappings",
    "split_kv_biases",
    "split_kv_weights",
    "split_qkv_biases",
    "split_qkv_weights",
]
