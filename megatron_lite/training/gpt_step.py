"""forward_step for GPT pretraining and SFT, with Megatron-Bridge's signature.

``forward_step(state, data_iterator, model)`` reads one microbatch, runs this stage's part of the
model and returns ``(output, loss_function)``; the training loop injects ``state`` (see
``prepare_forward_step_func``), so the schedules call it as ``forward_step_func(data_iterator, model)``.
A packed SFT batch's example boundaries reach the model as ``packed_seq_params`` on every pipeline
stage and model chunk (Megatron-Bridge #2952: a middle stage without them attends across examples).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch

from megatron_lite.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.utils import get_batch_on_this_cp_rank, get_thd_batch_on_this_cp_rank, unwrap_model
from megatron_lite.training.state import GlobalState
from megatron_lite.training.utils.packed_seq_utils import (
    batches_carry_boundaries,
    get_packed_seq_params,
    rows_of,
)

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def _per_token_loss(model) -> bool:
    """The model config's ``calculate_per_token_loss`` (False for a model without a config)."""
    while model is not None and not hasattr(model, "config"):
        model = getattr(model, "module", None)
    return bool(getattr(getattr(model, "config", None), "calculate_per_token_loss", False))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """``(masked loss sum, token count, {"lm loss": report})`` for this rank's part of one microbatch.

    The schedule divides the sum by the token count and the microbatch count (upstream's three-value
    contract), unless the model's config has ``calculate_per_token_loss``: then the schedules sum the
    token counts and finalize_model_grads divides the gradients by the step's total, so every answer
    token weighs the same whichever pack or microbatch holds it, and the report is upstream's
    ``[sum, tokens]`` (the loop's loss is the step's mean over all its tokens). Otherwise the report is
    this microbatch's mean per-token loss, which the loop averages over microbatches and data x context
    ranks (CP ranks hold equal token counts, so that is the mean).
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    # Computed before the schedule scales ``loss`` in place, so the report is unaffected by it.
    if _per_token_loss(model):
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), mask.sum().detach()])}
    return loss, num_tokens, {"lm loss": loss.detach() / mask.sum()}


def _packs(cfg) -> bool:
    """Whether the run's SFT rows are packs of several examples (the SFT dataset's ``packing``)."""
    return bool(getattr(getattr(cfg, "dataset", None), "packing", False))


def _pg_collection(model) -> ProcessGroupCollection:
    """The groups the model was built with (parallel_state's when it has none)."""
    groups = getattr(unwrap_model(model), "pg_collection", None)
    return groups if groups is not None else ProcessGroupCollection.use_mpu_process_groups()


def get_batch(data_iterator: Iterable, cfg=None, use_mtp: bool = False, *, pg_collection, vp_stage=None):
    """Next microbatch as ``(tokens, labels, loss_mask, attention_mask, position_ids,
    packed_seq_params)``, sliced to this CP rank; ``packed_seq_params`` (Megatron-Bridge's
    get_packed_seq_params of the batch's ``cu_seqlens``) is None for a batch without boundaries.

    A middle pipeline stage (neither the first nor the last rank of ``pg_collection.pp``) needs no
    tokens or labels: it runs on the received activations. Without packed sequences it reads nothing
    (reading a batch it never uses would only take CPU from the stages that compute). With them
    (``cfg``'s data carries boundaries: ``batches_carry_boundaries``) it reads its own iterator too —
    every rank and model chunk has one over the same samples, read once per microbatch in the
    schedule's order — and keeps only the boundaries, which its attention and RoPE need (Megatron-LM
    and Megatron-Bridge read the batch there too). No extra communication; correct at any pipeline
    size and for every interleaved chunk. The first stage uses the tokens, the last the labels.
    """
    if use_mtp:
        raise NotImplementedError("multi-token prediction is not supported")
    pp = pg_collection.pp
    middle = pp is not None and not (is_pp_first_stage(pp) or is_pp_last_stage(pp))
    if middle and not batches_carry_boundaries(cfg):
        return None, None, None, None, None, None
    sample = next(data_iterator)
    packed_seq_params = None
    # Rows of one example each (unpacked SFT, micro batch size > 1) need no boundaries: causal
    # attention already keeps an example from its masked pad tail. Packs come one per micro batch
    # (validation refuses packing with --micro-batch-size > 1; get_packed_seq_params checks it).
    if sample.get("cu_seqlens") is not None and (rows_of(sample) == 1 or _packs(cfg)):
        packed_seq_params = get_packed_seq_params(sample)
    if middle:
        return None, None, None, None, None, packed_seq_params
    # Only the model's inputs: a blend's samples also carry their dataset_id.
    batch = {k: v for k, v in sample.items() if k in _BATCH_KEYS}
    cp = pg_collection.cp
    if cp is not None and cp.size() > 1:
        if packed_seq_params is None:
            batch = get_batch_on_this_cp_rank(batch, cp.rank(), cp.size())
        else:  # each example split over the CP ranks (2 cp chunks each, as Transformer Engine's thd)
            p = packed_seq_params
            batch, _ = get_thd_batch_on_this_cp_rank(
                batch, p.cu_seqlens_q, p.cu_seqlens_q_padded, p.max_seqlen_q, cp.size(), cp.rank()
            )
    return (*(batch.get(k) for k in _BATCH_KEYS), packed_seq_params)


def forward_step(state: GlobalState, data_iterator: Iterable, model, return_schedule_plan: bool = False):
    """Run this stage's part of the model on the next microbatch; returns ``(output, loss_function)``
    where the loss function is ``partial(loss_func, loss_mask, model=model)``."""
    if return_schedule_plan:
        raise NotImplementedError(
            "return_schedule_plan needs MoE expert-parallel comm overlap (not supported)"
        )
    device = next(unwrap_model(model).parameters()).device
    timer = state.timers("batch-generator", log_level=2)
    timer.start()
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_batch(
        data_iterator, state.cfg, pg_collection=_pg_collection(model)
    )
    timer.stop()
    tokens, labels, loss_mask, position_ids = (
        None if t is None else t.to(device, non_blocking=True)
        for t in (tokens, labels, loss_mask, position_ids)
    )
    inputs = dict(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask, labels=labels)
    if packed_seq_params is not None:
        # Its boundaries stay on the host, where the attention reads them (a device copy would only be
        # read back).
        inputs["packed_seq_params"] = packed_seq_params
    output = model(**inputs)
    return output, partial(loss_func, loss_mask, model=model)
