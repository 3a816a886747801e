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


def moe_metrics(config, pg_collection, num_microbatches: int, iteration: int) -> tuple[dict, str] | None:
    """``(scalars, console text)`` of the step just run, on the iterations that log (to the dashboards
    or the console; empty on the others); None for a dense model. Call it on every rank, every
    iteration (it clears what the routers recorded): on a logged one it is collective over the
    pipeline, sequence-split and data-parallel groups, decided by the iteration alone."""
    m = config.model
    if not getattr(m, "num_moe_experts", None):
        return None
    lg = config.logger
    if iteration % lg.tensorboard_log_interval and iteration % lg.log_interval:
        get_moe_metrics_tracker().clear()
        return {}, ""
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


def upstream_moe_logging(
    track_moe_metrics, config, iteration, writer, total_loss_dict, pg_collection, num_microbatches: int
) -> str:
    """Upstream's call of ``track_moe_metrics`` (Megatron-Bridge's training_log; train_utils passes its
    own binding, which upstream's tests patch): the losses the router configuration names, added
    through ``writer`` (``add_scalar``: the step's metrics, which reach every sink; None on a rank
    without sinks); returns the console text. Collective on every rank."""
    model = config.model
    balancing = getattr(model, "moe_router_load_balancing_type", "")
    # Upstream's substring tests: "seq_aux_loss" also names "load_balancing_loss".
    track_names = [
        name
        for name, on in (
            ("load_balancing_loss", "aux_loss" in balancing),
            ("seq_load_balancing_loss", "seq_aux_loss" in balancing),
            ("global_load_balancing_loss", "global_aux_loss" in balancing),
            ("z_loss", getattr(model, "moe_z_loss_coeff", None) is not None),
        )
        if on
    ]
    return track_moe_metrics(
        loss_scale=1 / num_microbatches,
        iteration=iteration,
        writer=writer,
        wandb_writer=None,  # the writer above reaches W&B too
        total_loss_dict=total_loss_dict,
        per_layer_logging=getattr(model, "moe_per_layer_logging", False),
        force_initialize=True,
        track_names=track_names,
        num_layers=getattr(model, "num_layers", None),
        moe_layer_freq=getattr(model, "moe_layer_freq", None),
        mtp_num_layers=getattr(model, "mtp_num_layers", None),
        pg_collection=pg_collection,
        seq_group=getattr(
            pg_collection, "tp_cp" if getattr(model, "sequence_parallel", False) else "cp", None
        ),
    )
