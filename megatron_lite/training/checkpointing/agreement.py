"""Every rank takes the same decision about a checkpoint: one rank's error is every rank's."""

from __future__ import annotations

import shutil

import torch.distributed as dist

from megatron_lite.training.checkpointing.safety import CheckpointError


def agree(error: str | None, cleanup: str | None = None) -> None:
    """Raise the same CheckpointError on every rank if any rank failed, rank 0 first removing
    ``cleanup`` (a partial save). Collective over the world."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        if cleanup and dist.get_rank() == 0:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise CheckpointError(first)
