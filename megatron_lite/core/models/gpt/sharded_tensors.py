"""megatron-core's ``GPTModel.sharded_state_dict``: every state-dict entry of a model chunk as the
``ShardedTensor`` (or, for a gated ``linear_fc1``, the ``ShardedTensorFactory``) that places it in
the checkpoint's global tensors. The places are ``sharded_state_dict.chunk_slabs``' (the same
``torch_dist`` layout training's checkpoints write), so a checkpoint saved at one TP / PP loads at any
other. Replica ids are upstream's ``(pipeline copy, TP rank of a TP-replicated tensor, DP rank)``:
the main replica (all zeros) is the one rank that writes a tensor."""

from __future__ import annotations

import torch

from megatron_lite.core import parallel_state
from megatron_lite.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron_lite.core.dist_checkpointing.slabs import Slab
from megatron_lite.core.models.gpt.sharded_state_dict import chunk_slabs
from megatron_lite.core.process_group_utils import get_pg_rank, get_pg_size


def ensure_metadata_has_dp_cp_group(metadata: dict | None) -> dict:
    """``metadata`` (a new dict when None) with upstream's ``dp_cp_group`` entry set if it lacks one:
    a caller reads back the group its sharded state dict was made for."""
    metadata = {} if metadata is None else metadata
    if "dp_cp_group" not in metadata:
        initialized = parallel_state.model_parallel_is_initialized()  # None in a single process
        metadata["dp_cp_group"] = (
            parallel_state.get_data_parallel_group(with_context_parallel=True) if initialized else None
        )
    return metadata


def _stacked(config) -> bool:
    """Upstream stacks the layers on one axis unless dense and MoE layers are mixed (``moe_layer_freq``)."""
    freq = getattr(config, "moe_layer_freq", 1)
    return not (config.num_moe_experts and (isinstance(freq, list) or freq > 1))


def _experts(config) -> tuple[int, int, int, int]:
    """(this rank's first global expert, number of experts, expert-TP rank, expert-TP size)."""
    if not config.num_moe_experts or not parallel_state.model_parallel_is_initialized():
        return 0, config.num_moe_experts or 1, 0, 1
    local = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    return (
        parallel_state.get_expert_model_parallel_rank() * local,
        config.num_moe_experts,
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )


def _placed(slab: Slab, key: str, data: torch.Tensor, replica_id, mismatch: bool) -> ShardedTensor:
    """Rows ``[slab.start, slab.stop)`` of ``data`` at their place in global tensor ``key``; the stacked
    layer and expert axes are prepended (``prepend_axis_num``), as upstream's layers do."""
    axes = [a for a in (slab.layer, slab.expert) if a is not None]  # [layer, expert, ...]
    part = (
        data
        if slab.start == 0 and slab.stop == (data.shape[0] if data.dim() else 1)
        else data[slab.start : slab.stop]
    )
    return ShardedTensor(
        key,
        part,
        part.dtype,
        tuple(part.shape),
        tuple(a[1] for a in axes) + tuple(slab.global_shape),
        tuple(a[0] for a in axes) + tuple(slab.global_offset),
        None,  # an irregular grid: a padded vocabulary, a gated fc1's two halves
        replica_id,
        prepend_axis_num=len(axes),
        allow_shape_mismatch=mismatch,
    )


def _entry(slabs: list[Slab], prefix: str, data: torch.Tensor, replica_id, mismatch: bool):
    """One state-dict entry: a ShardedTensor, or a factory when it is several pieces (the factory's
    key and data are the ones it is built with, so an optimizer state can reuse it)."""
    if len(slabs) == 1:
        return _placed(slabs[0], prefix + slabs[0].key, data, replica_id, mismatch)

    def build(key, tensor, replica, _flattened_range=None):
        return [_placed(s, key, tensor, replica, mismatch) for s in slabs]

    return ShardedTensorFactory(
        prefix + slabs[0].key, data, build, lambda loaded: torch.cat(loaded), replica_id
    )


def gpt_sharded_state_dict(
    model, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
):
    """``{state-dict key: ShardedTensor or factory}`` for one GPTModel chunk (upstream's
    ``GPTModel.sharded_state_dict``): global keys as upstream's (stacked layers, Transformer Engine's
    layer-norm names), the tied output layer of a last stage without the embedding read from
    ``embedding.word_embeddings.weight`` and never written. Sets ``metadata['dp_cp_group']``."""
    assert not sharded_offsets, "Unexpected sharded offsets"
    ensure_metadata_has_dp_cp_group(metadata)
    config = model.config
    tp_rank, tp_size = get_pg_rank(model.tp_group), get_pg_size(model.tp_group)
    layers = model.decoder.layers
    initialized = parallel_state.model_parallel_is_initialized()
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True) if initialized else 0
    edp_rank = parallel_state.get_expert_data_parallel_rank() if initialized and config.num_moe_experts else 0
    experts = _experts(config)
    placement = chunk_slabs(
        model,
        layer_offset=layers[0].layer_number - 1 if len(layers) else 0,
        num_layers=config.num_layers,
        tp_rank=tp_rank,
        tp_size=tp_size,
        gated=bool(config.gated_linear_unit),
        tied=model.share_embeddings_and_output_weights,
        stacked=_stacked(config),
        experts=experts,
    )
    out = {}
    for name, tensor in model.state_dict(prefix="", keep_vars=True).items():
        if tensor not in placement:  # not a parameter (a persistent buffer): every rank holds it whole
            slab = Slab(
                name, 0, tensor.shape[0] if tensor.dim() else 1, (0,) * tensor.dim(), tuple(tensor.shape)
            )
            out[prefix + name] = _placed(slab, prefix + name, tensor, (0, tp_rank, dp_rank), False)
            continue
        slabs, replicated, read_only, routed = placement[tensor]
        if read_only:  # a copy of the first stage's embedding
            replica = (1, 0, dp_rank)
        elif routed:
            replica = (0, experts[2] if replicated else 0, edp_rank)
        else:
            replica = (0, tp_rank if replicated else 0, dp_rank)
        out[prefix + name] = _entry(slabs, prefix, tensor, replica, slabs[0].allow_shape_mismatch)
    return out
