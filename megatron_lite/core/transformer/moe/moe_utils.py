"""megatron.core.transformer.moe.moe_utils: the Switch Transformer load-balancing loss and the
ST-MoE z-loss, the autograd hook that adds an auxiliary loss's gradient to the backward pass, the
default MoE process groups, and track_moe_metrics (upstream's logging entry point over moe_logging's
tracker). The routing arithmetic lives in ``routing`` and is re-exported here under upstream's path."""

from __future__ import annotations

import torch

from megatron_lite.core import parallel_state
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.moe.routing import (  # noqa: F401  (upstream's import path)
    RandomSTE,
    RouterGatingLinearFunction,
    apply_random_logits,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    get_capacity,
    get_updated_expert_bias,
    group_limited_topk,
    router_gating_linear,
    sinkhorn,
    topk_routing_with_score_function,
)


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
    fused: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``coeff * E * sum_i f_i P_i``: f_i the fraction of the ``total_num_tokens`` x topk routings that
    chose expert i (``tokens_per_expert``, counted over the whole sequence), P_i the mean probability
    given to it. ``probs`` may be this rank's part of the sequence only: the parts' losses then add
    up to the whole sequence's. ``padding_mask`` [tokens], True for the tokens that count."""
    if fused:
        raise ValueError(
            "the fused load-balancing loss needs Transformer Engine, which megatron_lite does not use"
        )
    if padding_mask is not None:
        probs = probs * padding_mask.unsqueeze(-1)
    aggregated_probs_per_expert = probs.sum(dim=0)
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    )


def z_loss_func(
    logits: torch.Tensor, z_loss_coeff: float, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``coeff * mean(logsumexp(logits)^2)``: keeps the router's logits small. ``padding_mask``
    [tokens], True at padding: the mean is over the other tokens."""
    z = torch.square(torch.logsumexp(logits, dim=-1))
    if padding_mask is None:
        return torch.mean(z) * z_loss_coeff
    valid = ~padding_mask
    return (z * valid).sum() / torch.clamp(valid.sum(), min=1.0) * z_loss_coeff


def get_default_pg_collection() -> ProcessGroupCollection:
    """parallel_state's groups (those a MoE layer uses among them); no groups before it is
    initialised, which a MoE layer reads as no parallelism."""
    if not parallel_state.is_initialized():
        return ProcessGroupCollection()
    return ProcessGroupCollection.use_mpu_process_groups()


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` that hands ``aux_loss`` a gradient of ``main_loss_backward_scale`` in
    backward, so an auxiliary loss is trained without being added to the returned loss. The schedule
    sets the scale to the main loss's (1 / microbatches)."""

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scale = torch.tensor(1.0, device=aux_loss.device)
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The scale the schedule gives the main loss; the aux losses' gradients take the same."""
        if MoEAuxLossAutoScaler.main_loss_backward_scale is None:
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().clone()
        else:
            MoEAuxLossAutoScaler.main_loss_backward_scale.copy_(scale)


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return source.new_zeros((rows, source.size(-1))).index_add_(0, index, source)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def combine_rows(source: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` x h zeros with each row of ``source`` [n, h] added at row ``index[i]``: the tokens'
    expert outputs summed back into token order. The values of ``index_add``, but what its backward
    keeps is the index alone (autograd's ``index_add`` saves its source too, for its shape), as
    megatron-core's ``unpermute``, a ``scatter_add``, keeps no source."""
    return _CombineRows.apply(source, index, rows)


def track_moe_metrics(
    loss_scale: float,
    iteration: int,
    writer=None,
    wandb_writer=None,
    total_loss_dict: dict | None = None,
    per_layer_logging: bool = False,
    force_initialize: bool = False,
    track_names: list[str] | None = None,
    num_layers: int | None = None,
    num_moe_layers: int | None = None,
    moe_layer_freq: int | list[int] | None = None,
    mtp_num_layers: int | None = None,
    pg_collection=None,
    *,
    seq_group=None,
) -> str:
    """Upstream's entry point to the MoE metrics tracker: reduce the auxiliary losses the routers
    recorded this step (``track_names``; None: every recorded one), write each to ``writer``
    (``add_scalar``) and ``wandb_writer`` (``log``), add the losses to ``total_loss_dict`` and return
    the console text of the rest; then clear. The mean is over ``num_moe_layers`` MoE layers (else
    counted from ``num_layers`` and ``moe_layer_freq``), the sum over microbatches times
    ``loss_scale``. Ours: ``seq_group`` is the group that splits a sequence (tensor-parallel under
    sequence parallelism, and context parallel), whose losses add up (upstream records it per metric);
    None when nothing splits it. Missing names count as zeros on every rank, so ``force_initialize``
    is implied. Collective over the pipeline, ``seq_group`` and data-parallel groups: call it on every
    rank of a MoE model."""
    from megatron_lite.core.process_group_utils import get_collective_device
    from megatron_lite.core.process_groups_config import ProcessGroupCollection
    from megatron_lite.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    if mtp_num_layers:
        raise NotImplementedError("multi-token prediction is not supported by megatron_lite")
    if num_layers is None:
        raise ValueError("num_layers must be provided to track MoE metrics.")
    tracker = get_moe_metrics_tracker()
    names = [track_names] if isinstance(track_names, str) else track_names
    names = list(tracker.losses) if names is None else names
    if num_moe_layers is None:
        freq = 1 if moe_layer_freq is None else moe_layer_freq
        pattern = [int(i % freq == 0) for i in range(num_layers)] if isinstance(freq, int) else freq
        num_moe_layers = sum(pattern)
    if num_moe_layers <= 0:
        raise ValueError("MoE metrics require at least one MoE layer.")
    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    scalars, _ = tracker.report(
        pg_collection=pg_collection,
        seq_group=seq_group,
        num_microbatches=1 / loss_scale,
        moe_layers=list(range(num_moe_layers)),  # only their count matters without token counts
        loss_names=names,
        num_layers=num_layers,
        num_experts=None,
        device=get_collective_device(pg_collection.pp),
        per_layer=per_layer_logging,
    )
    console = {}
    for name, value in scalars.items():
        if writer is not None:
            writer.add_scalar(name, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: value}, iteration)
        if name in names and name.lower().endswith("loss") and total_loss_dict is not None:
            previous = total_loss_dict.get(name)
            total_loss_dict[name] = torch.tensor(value) + (0 if previous is None else previous)
        elif name in names:
            console[name] = value
    return "".join(f" {name}: {value:.2f} |" for name, value in console.items())
