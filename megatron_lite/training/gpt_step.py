"""forward_step for GPT pretraining, in the shape the schedules expect."""

from __future__ import annotations

from functools import partial

import torch

from megatron_lite.core import parallel_state
from megatron_lite.core.utils import get_batch_on_this_cp_rank


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean per-token loss of this rank's part of one microbatch; reported as ``lm loss``.

    Under context parallelism every CP rank holds the same number of tokens, so averaging these means
    over the CP ranks (gradients and reports are averaged over the data x context group) gives the
    microbatch's mean."""
    losses = output_tensor.float()
    loss = torch.sum(losses.reshape(-1) * loss_mask.reshape(-1)) / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    """Read the next microbatch and run this stage's part of the model on it.

    Every stage reads the batch (the synthetic data is cheap and identical everywhere), which keeps all
    stages' data position equal; only the first stage uses the tokens, only the last the labels.
    """
    device = next(model.parameters()).device
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    if parallel_state.model_parallel_is_initialized():
        cp_rank, cp_size = (
            parallel_state.get_context_parallel_rank(),
            parallel_state.get_context_parallel_world_size(),
        )
        batch = get_batch_on_this_cp_rank(batch, cp_rank, cp_size)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])
