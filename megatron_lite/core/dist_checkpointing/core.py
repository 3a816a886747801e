"""What every checkpointing module shares (megatron-core's ``dist_checkpointing.core``): its exception
and the ``metadata.json`` that marks a directory as a distributed checkpoint (its backends)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception):
    """A checkpoint that cannot be saved or does not hold what a load asks for (megatron-core's name)."""


@dataclass
class CheckpointingConfig:
    """What ``metadata.json`` records: how the sharded and the common parts were written."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


def check_is_distributed_checkpoint(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` holds a ``metadata.json`` (written last by a save)."""
    return maybe_load_config(checkpoint_dir) is not None


def maybe_load_config(checkpoint_dir: str) -> CheckpointingConfig | None:
    """``checkpoint_dir``'s ``metadata.json``; None when it has none."""
    path = os.path.join(str(checkpoint_dir), CONFIG_FNAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return CheckpointingConfig(**json.load(f))


def save_config(config: CheckpointingConfig, checkpoint_dir: str) -> None:
    """Write ``metadata.json`` into ``checkpoint_dir`` (one rank does)."""
    with open(os.path.join(str(checkpoint_dir), CONFIG_FNAME), "w") as f:
        json.dump(asdict(config), f)
