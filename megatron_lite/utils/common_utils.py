"""Rank and world size that also answer before torch.distributed is initialised, and the rank-gated
prints and warnings built on them (upstream's ``print_rank_0`` / ``warn_rank_0`` / ``print_rank_last``)."""

from __future__ import annotations

import os
import warnings

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


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only (every rank before torch.distributed is initialized)."""
    if get_rank_safe() == 0:
        print(message, flush=True)


def warn_rank_0(message: str) -> None:
    """Warn (``warnings.warn``) on global rank 0 only."""
    if get_rank_safe() == 0:
        warnings.warn(message, stacklevel=2)


def print_rank_last(message: str) -> None:
    """Print on the last global rank only, where the loggers live."""
    if get_rank_safe() == get_world_size_safe() - 1:
        print(message, flush=True)
