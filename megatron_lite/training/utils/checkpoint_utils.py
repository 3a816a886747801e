"""Upstream's path (``megatron.bridge.training.utils.checkpoint_utils``) to the filesystem questions
the checkpoint config asks before any worker starts."""

from __future__ import annotations

import os

TRACKER = "latest_checkpointed_iteration.txt"


def file_exists(path: str) -> bool:
    """Whether ``path`` (a file or a directory) exists on the local or shared filesystem."""
    return os.path.exists(path)


def checkpoint_exists(checkpoints_path: str | None) -> bool:
    """Whether ``checkpoints_path`` holds a checkpoint to resume from (its iteration tracker)."""
    return checkpoints_path is not None and file_exists(os.path.join(checkpoints_path, TRACKER))
