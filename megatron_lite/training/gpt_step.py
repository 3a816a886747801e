"""forward_step for GPT pretraining, in the shape the schedules expect."""

from __future__ import annotations

from functools import partial

import torch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean per-token loss of one microbatch; the detached value is reported as ``lm loss``."""
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
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])
