"""forward_step for GPT pretraining, with Megatron-Bridge's signature.

``forward_step(state, data_iterator, model)`` reads one microbatch, runs this stage's part of the
model and returns ``(output, loss_function)``; the training loop injects ``state`` (see
``prepare_forward_step_func``), so the schedules call it as ``forward_step_func(data_iterator, model)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch

from megatron_lite.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.utils import get_batch_on_this_cp_rank, unwrap_model
from megatron_lite.training.state import GlobalState

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """``(masked loss sum, token count, {"lm loss": mean})`` for this rank's part of one microbatch.

    The schedule divides the sum by the token count and the microbatch count (upstream's three-value
    contract). The report stays this microbatch's mean per-token loss, which the training loop averages
    over microbatches and data x context ranks (CP ranks hold equal token counts, so that is the mean).
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1)
    loss = torch.sum(losses * mask)
    # Computed before the schedule scales ``loss`` in place, so the report is unaffected by it.
    reported = loss.detach() / mask.sum()
    return loss, mask.sum().to(torch.int), {"lm loss": reported}


def _pg_collection(model) -> ProcessGroupCollection:
    """The groups the model was built with (parallel_state's when it has none)."""
    groups = getattr(unwrap_model(model), "pg_collection", None)
    return groups if groups is not None else ProcessGroupCollection.use_mpu_process_groups()


def get_batch(data_iterator: Iterable, cfg=None, use_mtp: bool = False, *, pg_collection, vp_stage=None):
    """Next microbatch as ``(tokens, labels, loss_mask, attention_mask, position_ids, None)`` (the
    last item is upstream's packed-sequence metadata, which we do not have), sliced to this CP rank.

    As upstream, a middle pipeline stage (neither the first nor the last rank of ``pg_collection.pp``)
    reads nothing and gets Nones: it runs on the received activations, and reading a batch it never
    uses would only take CPU from the stages that compute. The first stage uses the tokens, the last
    the labels and loss mask.
    """
    if use_mtp:
        raise NotImplementedError("multi-token prediction is not supported")
    pp = pg_collection.pp
    if pp is not None and not (is_pp_first_stage(pp) or is_pp_last_stage(pp)):
        return None, None, None, None, None, None
    # Only the model's inputs: a blend's samples also carry their dataset_id.
    batch = {k: v for k, v in next(data_iterator).items() if k in _BATCH_KEYS}
    if pg_collection.cp is not None:
        batch = get_batch_on_this_cp_rank(batch, pg_collection.cp.rank(), pg_collection.cp.size())
    return (*(batch.get(k) for k in _BATCH_KEYS), None)


def forward_step(state: GlobalState, data_iterator: Iterable, model, return_schedule_plan: bool = False):
    """Run this stage's part of the model on the next microbatch; returns ``(output, loss_function)``
    where the loss function is ``partial(loss_func, loss_mask)``."""
    if return_schedule_plan:
        raise NotImplementedError(
            "return_schedule_plan needs MoE expert-parallel comm overlap (not supported)"
        )
    device = next(unwrap_model(model).parameters()).device
    timer = state.timers("batch-generator", log_level=2)
    timer.start()
    tokens, labels, loss_mask, attention_mask, position_ids, _ = get_batch(
        data_iterator, state.cfg, pg_collection=_pg_collection(model)
    )
    timer.stop()
    tokens, labels, loss_mask, position_ids = (
        None if t is None else t.to(device, non_blocking=True)
        for t in (tokens, labels, loss_mask, position_ids)
    )
    output = model(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)
