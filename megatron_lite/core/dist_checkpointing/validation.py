"""Checking a load against a checkpoint (megatron-core's ``dist_checkpointing.validation``): how a
mismatch between the requested keys and the saved ones is handled, and the exchange of every rank's
piece metadata that a global check needs."""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from enum import Enum

import torch

from megatron_lite.core.dist_checkpointing.core import CheckpointingException, check_is_distributed_checkpoint
from megatron_lite.core.dist_checkpointing.dict_utils import diff, extract_matching_values, nested_values
from megatron_lite.core.dist_checkpointing.mapping import (
    CommonStateDict,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)

logger = logging.getLogger(__name__)


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


# The values that compare the keys nobody asks for with the checkpoint's (the *_UNEXPECTED ones do not).
_CONSIDER_MISSING = (
    StrictHandling.LOG_ALL,
    StrictHandling.RAISE_ALL,
    StrictHandling.RETURN_ALL,
    StrictHandling.IGNORE_ALL,
)


def parse_strict_flag(strict: bool | str | StrictHandling) -> StrictHandling:
    """``strict`` as a StrictHandling: True is ASSUME_OK_UNEXPECTED, False LOG_UNEXPECTED, a string
    its value."""
    if isinstance(strict, bool):
        return StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    try:
        return StrictHandling(strict)
    except ValueError as e:
        raise ValueError(f"Invalid strict flag: {e}") from e


def verify_checkpoint(checkpoint_dir: str) -> None:
    """A CheckpointingException unless ``checkpoint_dir`` is a finished distributed checkpoint."""
    if not os.path.isdir(str(checkpoint_dir)):
        raise CheckpointingException(f"Checkpoint directory {checkpoint_dir} does not exist")
    if not check_is_distributed_checkpoint(checkpoint_dir):
        raise CheckpointingException(f"{checkpoint_dir} is not a distributed checkpoint")


def maybe_report_missing_and_unexpected_keys(
    missing_keys: set[str], unexpected_keys: set[str], raise_error: bool = True
) -> None:
    """One message naming both kinds of mismatch, raised or logged; nothing when there is none."""
    parts = []
    if missing_keys:
        parts.append(
            "Some keys found in the checkpoint are missing in the provided sharded state dict. "
            f"Missing keys (for all ranks): {missing_keys}. "
        )
    if unexpected_keys:
        parts.append(
            "Unexpected keys (not found in the checkpoint) encountered in the provided sharded state "
            f"dict. Unexpected keys (for this rank): {unexpected_keys}. "
        )
    if not parts:
        return
    if raise_error:
        raise CheckpointingException("".join(parts))
    logger.warning("".join(parts))


def validate_integrity_and_strict_load(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: list[ShardedBase] | None = None,
    global_metadata: list[list[ShardedBase]] | None = None,
    ckpt_sharded_metadata: dict[str, ShardedBase] | None = None,
) -> tuple[ShardedStateDict, set[str], set[str]]:
    """Check a load request against the checkpoint (``strict``) and, with
    ``validate_access_integrity``, that the ranks' main replicas together read every saved piece
    once. Returns the request without its unexpected keys, the missing keys (the same on every rank;
    empty unless ``strict`` considers them) and this rank's unexpected keys."""
    missing, unexpected = set(), set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException("Cannot verify checkpoint mismatch with ckpt_sharded_metadata=None.")
        if local_metadata is None:
            local_metadata = [piece.without_data() for piece in nested_values(sharded_state_dict)]
        saved = {piece.key for piece in ckpt_sharded_metadata.values()}
        unexpected = {piece.key for piece in local_metadata} - saved
        if global_metadata is not None and strict in _CONSIDER_MISSING:
            missing = saved - {piece.key for rank in global_metadata for piece in rank}
        _, sharded_state_dict = extract_matching_values(sharded_state_dict, lambda x: x.key in unexpected)
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, True)
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, False)
    if validate_access_integrity:
        if global_metadata is None:
            raise CheckpointingException("Cannot check sharding intergrity without global_metadata (None).")
        validate_sharding_integrity(global_metadata)
    return sharded_state_dict, missing, unexpected


def _box(piece: ShardedTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
    return tuple(piece.global_offset), tuple(o + s for o, s in zip(piece.global_offset, shape))


def _tensor_errors(key: str, pieces: list[ShardedTensor]) -> list[str]:
    """The main replicas of ``key``'s pieces must tile its global shape: no overlap, no gap."""
    shapes = {tuple(p.global_shape) for p in pieces}
    if len(shapes) > 1:
        return [f"{key} has different global shapes on different ranks: {sorted(shapes)}"]
    boxes = [_box(p) for p in pieces if is_main_replica(p.replica_id)]
    for i, (lo1, hi1) in enumerate(boxes):
        for lo2, hi2 in boxes[i + 1 :]:
            if all(a1 < b2 and a2 < b1 for a1, b1, a2, b2 in zip(lo1, hi1, lo2, hi2)):
                return [f"Invalid access pattern for {key}: main replicas overlap at {lo1} and {lo2}"]
    covered = sum(math.prod(b - a for a, b in zip(lo, hi)) for lo, hi in boxes)
    if covered != math.prod(shapes.pop()):
        return [
            f"Invalid access pattern for {key}: main replicas cover {covered} elements of {pieces[0].global_shape}"
        ]
    return []


def _object_errors(key: str, objects: list[ShardedObject]) -> list[str]:
    """Every shard of ``key``'s global array of objects has exactly one main replica."""
    main = [o.unique_key for o in objects if is_main_replica(o.replica_id)]
    if len(set(main)) != len(main):
        return [f"Duplicate ShardedObject keys: {sorted({k for k in main if main.count(k) > 1})}"]
    shape = objects[0].global_shape
    if all(s > 0 for s in shape) and len(main) != math.prod(shape):
        return [f"Invalid access pattern: {math.prod(shape) - len(main)} ShardedObject are missing ({key})."]
    return []


def validate_sharding_integrity(
    global_metadata: list[list[ShardedBase]], common_state_dict: CommonStateDict | None = None
) -> None:
    """Every rank's pieces (``determine_global_metadata``) save or load each tensor and object once;
    the same CheckpointingException on every rank otherwise (they all check the same metadata).
    ``common_state_dict``: compared with rank 0's, a difference logged (collective)."""
    if common_state_dict is not None:
        _validate_common_state_dict(common_state_dict)
    by_key: dict[str, list] = defaultdict(list)
    for rank in global_metadata:
        for piece in rank:
            by_key[piece.key].append(piece)
    errors = []
    for key, pieces in by_key.items():
        if isinstance(pieces[0], ShardedTensor):
            errors += _tensor_errors(key, pieces)
        elif isinstance(pieces[0], ShardedObject):
            errors += _object_errors(key, pieces)
    if errors:
        raise CheckpointingException(f"Invalid sharding pattern validation. Errors: {errors}")


def _validate_common_state_dict(common_state_dict: CommonStateDict) -> None:
    """Log, on each rank but 0, where its common state dict differs from rank 0's. Collective."""
    rank0 = [common_state_dict]
    torch.distributed.broadcast_object_list(rank0, src=0)
    rank = torch.distributed.get_rank()
    if rank == 0:
        return
    only_rank0, only_here, mismatch = diff(rank0[0], common_state_dict)
    if only_rank0 or only_here or mismatch:
        logger.warning(
            f"Rank {rank} common state dict differs from rank 0 common state dict. "
            f"Keys only on rank 0: {only_rank0}, Keys only on {rank}: {only_here}, "
            f"Mismatched keys: {mismatch}"
        )
