"""Checking a load against a checkpoint (megatron-core's ``dist_checkpointing.validation``): how a
mismatch between the requested keys and the saved ones is handled, and the exchange of every rank's
piece metadata that a global check needs."""

from __future__ import annotations

from enum import Enum

import torch

from megatron_lite.core.dist_checkpointing.dict_utils import nested_values
from megatron_lite.core.dist_checkpointing.mapping import ShardedBase, ShardedStateDict


class StrictHandling(Enum):
    """What a load does with "unexpected" keys (requested, not in the checkpoint) and "missing" ones
    (in the checkpoint, not requested). ``*_UNEXPECTED`` ignore missing keys, so need no exchange of
    metadata between ranks; ``*_ALL`` consider both."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"  # the load itself fails on an unexpected key
    LOG_UNEXPECTED = "log_unexpected"  # a warning per unexpected key
    LOG_ALL = "log_all"  # a warning per mismatched key
    RAISE_UNEXPECTED = "raise_unexpected"  # an error before the load
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"  # returned beside the loaded state dict
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        """Whether ``val`` compares the request with the checkpoint's keys before the load."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        """Whether ``val`` needs every rank's request (``determine_global_metadata``)."""
        return val in (
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        """Whether ``load`` returns the mismatched keys as well."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def determine_global_metadata(
    sharded_state_dict: ShardedStateDict, process_group: torch.distributed.ProcessGroup | None = None
) -> tuple[list[ShardedBase], list[list[ShardedBase]]]:
    """This rank's pieces without their data, and every rank's of ``process_group`` (the world by
    default: the ranks that together make one checkpoint). Collective over ``process_group``."""
    local = [piece.without_data() for piece in nested_values(sharded_state_dict)]
    everyone = [None] * torch.distributed.get_world_size(group=process_group)
    torch.distributed.all_gather_object(everyone, local, group=process_group)
    return local, everyone
