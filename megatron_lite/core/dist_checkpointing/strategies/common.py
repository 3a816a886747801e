"""The common (not sharded) part of a checkpoint (megatron-core's ``strategies.common``): one
``common.pt`` written by rank 0 with ``torch.save``, read back with torch's weights-only unpickler
(containers, numbers, strings and tensors; nothing that runs code)."""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from megatron_lite.core.dist_checkpointing.core import CheckpointingException
from megatron_lite.core.dist_checkpointing.mapping import StateDict

COMMON_STATE_FNAME = "common.pt"


def load_weights_only(source) -> Any:
    """``torch.load`` with torch's weights-only unpickler, io.BytesIO allowed besides (it runs no code):
    the one reader of pickled data in ``core`` (training's ``checkpointing.safety`` is a floor above)."""
    with torch.serialization.safe_globals([io.BytesIO]):
        return torch.load(source, map_location="cpu", weights_only=True)


class TorchCommonSaveStrategy:
    """Writes the common state dict to ``common.pt``."""

    def __init__(self, backend: str = "torch", version: int = 1):
        self.backend, self.version = backend, version

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: str) -> None:
        """Rank 0 writes; the others do nothing."""
        if torch.distributed.get_rank() == 0:
            torch.save(common_state_dict, os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME))


class TorchCommonLoadStrategy:
    """Reads ``common.pt``."""

    def load_common(self, checkpoint_dir: str) -> StateDict:
        """The common state dict; an empty one when the checkpoint has none (no rank had common
        values). A value outside what the weights-only unpickler builds is a CheckpointingException."""
        path = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
        if not os.path.exists(path):
            return {}
        try:
            return load_weights_only(path)
        except Exception as err:
            raise CheckpointingException(
                f"{path}: {str(err).splitlines()[0] if str(err) else err!r}"
            ) from None
