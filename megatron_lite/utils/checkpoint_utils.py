"""The filesystem questions (upstream: ``megatron.bridge.training.utils.checkpoint_utils``, importable there)
the checkpoint config asks before any worker starts."""

from __future__ import annotations

import os


def file_exists(path: str) -> bool:
    """Whether ``path`` (a file or a directory) exists on the local or shared filesystem."""
    return os.path.exists(path)
