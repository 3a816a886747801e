"""Rank and world size that also answer before torch.distributed is initialised."""

from __future__ import annotations

import os

import torch.distributed as dist


def get_rank_safe() -> int:
    """This process's global rank: torch.distributed's once initialised, else the launcher's RANK (0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def get_world_size_safe() -> int:
    """The world size: torch.distributed's once initialised, else the launcher's WORLD_SIZE (1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def get_local_rank_preinit() -> int:
    """This process's rank on its node, from the launcher's LOCAL_RANK (0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
