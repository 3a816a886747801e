"""The MoE metrics of a step (auxiliary losses, tokens per expert) reduced for the loggers."""

from __future__ import annotations

from megatron_lite.core.transformer.moe.moe_layer import moe_layer_pattern
from megatron_lite.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron_lite.core.utils import get_collective_device


def moe_loss_names(model_config) -> list[str]:
    """The auxiliary losses the routers record, as upstream names them."""
    names = []
    if model_config.moe_router_load_balancing_type == "aux_loss" and model_config.moe_aux_loss_coeff:
        names.append("load_balancing_loss")
    if model_config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def moe_metrics(config, pg_collection, num_microbatches: int) -> tuple[dict, str] | None:
    """``(scalars, console text)`` of the step just run; None for a dense model. Collective over the
    pipeline, sequence-split and data-parallel groups on every rank of a MoE model: call it on all
    of them, every iteration (it also clears what the routers recorded)."""
    m = config.model
    if not getattr(m, "num_moe_experts", None):
        return None
    pattern = moe_layer_pattern(m)
    seq_group = pg_collection.tp_cp if m.sequence_parallel else pg_collection.cp
    return get_moe_metrics_tracker().report(
        pg_collection=pg_collection,
        seq_group=seq_group,
        num_microbatches=num_microbatches,
        moe_layers=[i + 1 for i, moe in enumerate(pattern) if moe],
        loss_names=moe_loss_names(m),
        num_layers=m.num_layers,
        num_experts=m.num_moe_experts,
        device=get_collective_device(pg_collection.pp),
    )
