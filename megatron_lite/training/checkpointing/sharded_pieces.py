"""What each rank holds of a ``torch_dist`` checkpoint: its pieces of the weights (placed by
``core.models.gpt.sharded_state_dict``) and of the optimizer state (``core.optimizer.sharded_state``),
with the one rank that writes each piece, and the layout ``common.pt`` records."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.core.dist_checkpointing.mapping import flat_range_pieces
from megatron_lite.core.models.gpt.sharded_state_dict import chunk_slabs
from megatron_lite.core.optimizer.sharded_state import DISTRIBUTED_FP32_PARAM, FP32_PARAM, optimizer_pieces
from megatron_lite.core.transformer.pipeline_layer_split import chunk_layer_offset
from megatron_lite.training.checkpointing.distrib_optim import uses_distributed_optimizer
from megatron_lite.training.checkpointing.layout import expert_layout, model_chunks


def layout_record(model_cfg) -> dict:
    """This run's layout as ``common.pt`` records it; RNG streams carry over only when it is equal."""
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": model_cfg.virtual_pipeline_model_parallel_size or 1,
        "world_size": dist.get_world_size(),
        **expert_layout(),
    }


def stacked_layers(model_cfg) -> bool:
    """Upstream stacks the layers on one axis unless they differ (``moe_layer_freq`` mixing dense and
    MoE layers: TransformerBlock's ``non_homogeneous_layers``)."""
    freq = getattr(model_cfg, "moe_layer_freq", 1)
    return not (model_cfg.num_moe_experts and (isinstance(freq, list) or freq > 1))


def _experts(model_cfg) -> tuple[int, int, int, int]:
    """(this rank's first global expert, number of experts, expert-TP rank, expert-TP size)."""
    count = model_cfg.num_moe_experts or 1
    local = count // parallel_state.get_expert_model_parallel_world_size()
    return (
        parallel_state.get_expert_model_parallel_rank() * local,
        count,
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )


def _placement(model, model_cfg) -> dict:
    """``{parameter: (slabs, replicated, read_only, routed_expert)}`` over this rank's model chunks."""
    tp_rank, tp_size = parallel_state.get_tensor_model_parallel_rank(), model_cfg.tensor_model_parallel_size
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    found = {}
    for c, chunk in enumerate(model_chunks(model)):
        found.update(
            chunk_slabs(
                chunk,
                layer_offset=chunk_layer_offset(model_cfg, c, pp_rank),
                num_layers=model_cfg.num_layers,
                tp_rank=tp_rank,
                tp_size=tp_size,
                gated=bool(model_cfg.gated_linear_unit),
                tied=bool(model_cfg.share_embeddings_and_output_weights),
                stacked=stacked_layers(model_cfg),
                experts=_experts(model_cfg),
            )
        )
    return found


def _replica(replicated: bool, read_only: bool, owner: bool, expert: bool = False) -> int:
    """0 for the one rank that writes a piece: ``owner`` (this rank holds it for its data-parallel
    group: for a routed expert, its expert-data-parallel group), TP rank 0 (expert-TP rank 0) of a
    tensor every TP (expert-TP) rank holds, never a tied copy."""
    tp_rank = (
        parallel_state.get_expert_tensor_parallel_rank()
        if expert
        else parallel_state.get_tensor_model_parallel_rank()
    )
    return 0 if owner and not read_only and (tp_rank == 0 or not replicated) else 1


def sharded_pieces(
    model,
    optimizer,
    model_cfg,
    *,
    with_optimizer: bool,
    fp32_from: str | None = FP32_PARAM,
    moments: bool = True,
    fp32_weights_from: str = "",
    every_fp32: bool = False,
    only: set | None = None,
):
    """This rank's pieces of the checkpoint's tensors: its weights, and with ``with_optimizer`` its
    optimizer state (of its own shard with the distributed optimizer; ``moments`` False: its fp32
    main parameters only). ``fp32_weights_from``: the prefix fp32 weights are read from (a load into
    an fp32 model of a checkpoint with fp32 main parameters beside lower-precision weights).
    ``every_fp32``: every parameter's fp32 main weights, fp32 ones' too (torch_dist.fp32_mains).
    ``only``: these parameters alone (a PEFT checkpoint's adapters, ``peft.saved_parameters``)."""
    placement = _placement(model, model_cfg)
    if only is not None:
        placement = {p: where for p, where in placement.items() if p in only}
    dp_first = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    edp_first = parallel_state.get_expert_data_parallel_rank() == 0
    pieces = []
    for param, (slabs, replicated, read_only, expert) in placement.items():
        replica = _replica(replicated, read_only, edp_first if expert else dp_first, expert)
        prefix = fp32_weights_from if param.dtype == torch.float32 else ""
        pieces += flat_range_pieces(slabs, param.shape, param.detach().view(-1), 0, replica, prefix)
    if with_optimizer:
        sharded = uses_distributed_optimizer(optimizer)
        optim = {
            p: (slabs, _replica(rep, ro, sharded or (edp_first if ex else dp_first), ex))
            for p, (slabs, rep, ro, ex) in placement.items()
        }
        pieces += optimizer_pieces(
            optimizer, optim, fp32_from=fp32_from, moments=moments, every_fp32=every_fp32
        )
    return pieces


def fp32_mains(model, optimizer) -> tuple[str, bool, bool]:
    """Which fp32 main parameters a save writes: (their name, every parameter's, any at all). With
    lower-precision weights, their fp32 copies (``optimizer.state.fp32_param.``); with the distributed
    optimizer, every parameter's, as megatron-core's DistributedOptimizer saves them (under its
    fully_reshardable name, ``optimizer.state.param.``, so Megatron-LM's resume with it reads them)."""
    lower = any(p.dtype != torch.float32 for c in model_chunks(model) for p in c.parameters())
    distributed = uses_distributed_optimizer(optimizer)
    return (DISTRIBUTED_FP32_PARAM if distributed else FP32_PARAM), distributed, lower or distributed
