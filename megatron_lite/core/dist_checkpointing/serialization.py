"""megatron-core's entry points (``dist_checkpointing.serialization``): ``save`` and ``load`` of a
nested state dict whose tensors are wrapped in ``mapping``'s classes (what ``torch.save`` and a
weights-only ``torch.load`` are for a plain one). The ShardedTensors and ShardedObjects go through the sharded strategy
(DCP's files, ``strategies.torch``), every other value to ``common.pt`` (``strategies.common``), and
``metadata.json`` is written last. megatron_lite's list-based functions (``pieces``) are re-exported
here for their callers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_lite.core.dist_checkpointing.core import (
    CheckpointingConfig,
    CheckpointingException,
    save_config,
)
from megatron_lite.core.dist_checkpointing.dict_utils import merge
from megatron_lite.core.dist_checkpointing.mapping import (
    CommonStateDict,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    apply_factory_merges,
)
from megatron_lite.core.dist_checkpointing.pieces import (
    SaveRequest,
    check_data_files,
    load_metadata,
    load_pieces,
    missing_or_mismatched,
    plan_save,
    read_object_bytes,
    save_pieces,
)
from megatron_lite.core.dist_checkpointing.state_dict_utils import (
    extract_sharded_base,
    load_preprocess,
    save_preprocess,
)
from megatron_lite.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron_lite.core.dist_checkpointing.strategies.common import (
    TorchCommonLoadStrategy,
    TorchCommonSaveStrategy,
)
from megatron_lite.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron_lite.core.dist_checkpointing.validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
    verify_checkpoint,
)

logger = logging.getLogger(__name__)

__all__ = [  # upstream's, and megatron_lite's list-based functions (``pieces``) for their callers
    "CheckpointingException",
    "SaveRequest",
    "check_data_files",
    "get_default_load_sharded_strategy",
    "get_default_save_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_metadata",
    "load_pieces",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "missing_or_mismatched",
    "plan_save",
    "read_object_bytes",
    "save",
    "save_pieces",
]

CkptShardedMetadata = dict[str, ShardedTensor | ShardedObject]
_CONTENT_METADATA_KEY = "content_metadata"


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1):
    if backend != "torch_dist":
        raise CheckpointingException(f"sharded backend {backend!r}: megatron_lite writes torch_dist only")
    return TorchDistSaveShardedStrategy(backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: str | Path | None = None):
    return TorchDistLoadShardedStrategy(checkpoint_name=checkpoint_dir)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1):
    return TorchCommonSaveStrategy(backend, version)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: TorchDistSaveShardedStrategy | None = None,
    common_strategy: TorchCommonSaveStrategy | None = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict] | None = None,
    content_metadata: dict | None = None,
    async_strategy: str = "mcore",
) -> AsyncRequest | None:
    """Save ``sharded_state_dict`` into ``checkpoint_dir`` (which exists on rank 0 at least): its
    sharded values by ``sharded_strategy`` (the default: torch_dist), every other value by rank 0 into
    ``common.pt``, then ``metadata.json``. ``content_metadata`` is kept in the common part. With
    ``async_sharded_save`` the sharded files are written by the returned request, which the caller
    schedules (``AsyncCallsQueue``); ``metadata.json`` is written when it is finalized. Collective;
    ``sharded_state_dict`` is modified (factories built). ``async_strategy``: only megatron-core's own
    ("mcore"); NVRx is not available in megatron_lite."""
    if isinstance(sharded_state_dict, list):  # megatron_lite's own form: a rank's pieces (pieces.py)
        return save_pieces(sharded_state_dict, checkpoint_dir)
    if async_strategy not in ("mcore", None):
        raise CheckpointingException(f"async_strategy {async_strategy!r}: megatron_lite has only 'mcore'")
    if torch.distributed.get_rank() == 0 and next(Path(checkpoint_dir).iterdir(), None) is not None:
        logger.warning("Overwriting old incomplete / corrupted checkpoint...")
    if sharded_strategy is None or isinstance(sharded_strategy, tuple):  # upstream's (backend, version) too
        sharded_strategy = get_default_save_sharded_strategy(*(sharded_strategy or ()))
    common_strategy = common_strategy or get_default_save_common_strategy()
    if content_metadata is not None:
        sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata
    sharded_part, common = save_preprocess(
        sharded_state_dict, validate_access_integrity, preprocess_common_before_consistancy_check
    )
    common_strategy.save_common(common, checkpoint_dir)

    def write_config() -> None:
        if torch.distributed.get_rank() == 0:
            save_config(
                CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version), checkpoint_dir
            )
        torch.distributed.barrier()  # the checkpoint is complete on every rank's return

    if not async_sharded_save:
        sharded_strategy.save(sharded_part, checkpoint_dir)
        write_config()
        return None
    request = sharded_strategy.async_save(sharded_part, checkpoint_dir)
    request.add_finalize_fn(write_config)
    return request


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: TorchDistLoadShardedStrategy | None = None,
    common_strategy: TorchCommonLoadStrategy | None = None,
    validate_access_integrity: bool = True,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """The checkpoint's common part with, in their places, the values ``sharded_state_dict`` asks for
    (each ShardedTensor's piece, each ShardedObject's object, factories merged back). ``strict`` says
    what a key the checkpoint lacks, or one nobody asks for, does (``StrictHandling``; the RETURN_*
    values also return the missing and unexpected keys); ``validate_access_integrity`` checks that
    the ranks' main replicas read each value once. Collective. A list of pieces is megatron_lite's own
    form (pieces.py): read in place."""
    if isinstance(sharded_state_dict, list):
        return load_pieces(sharded_state_dict, checkpoint_dir)
    verify_checkpoint(checkpoint_dir)
    if sharded_strategy is None or isinstance(sharded_strategy, tuple):  # a (backend, version): torch_dist
        sharded_strategy = get_default_load_sharded_strategy(checkpoint_dir)
    common_strategy = common_strategy or TorchCommonLoadStrategy()
    sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
    common = common_strategy.load_common(checkpoint_dir)
    merge(common, nonpersistent)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)
    strict = parse_strict_flag(strict)
    saved = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        saved = load_sharded_metadata(checkpoint_dir, sharded_strategy)
    local, everyone = None, None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local, everyone = determine_global_metadata(sharded_state_dict)
    sharded_state_dict, missing, unexpected = validate_integrity_and_strict_load(
        sharded_state_dict, strict, validate_access_integrity, local, everyone, saved
    )
    merge(common, sharded_strategy.load(sharded_state_dict, checkpoint_dir))
    common = apply_factory_merges(common, factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common, missing, unexpected
    return common


def load_common_state_dict(checkpoint_dir: str | Path) -> StateDict:
    """The checkpoint's common (not sharded) values."""
    verify_checkpoint(str(checkpoint_dir))
    return TorchCommonLoadStrategy().load_common(checkpoint_dir)


def load_tensors_metadata(
    checkpoint_dir: str, sharded_strategy: TorchDistLoadShardedStrategy | None = None
) -> CkptShardedMetadata:
    """Every saved tensor by its key (not a state dict key), as an unsharded ShardedTensor without
    data: its global shape and dtype. ``load`` of it reads the whole tensors."""
    verify_checkpoint(checkpoint_dir)
    return (sharded_strategy or TorchDistLoadShardedStrategy()).load_tensors_metadata(checkpoint_dir)


def load_sharded_metadata(
    checkpoint_dir: str, sharded_strategy: TorchDistLoadShardedStrategy | None = None
) -> CkptShardedMetadata:
    """``load_tensors_metadata`` and every saved ShardedObject shard by its unique key."""
    verify_checkpoint(checkpoint_dir)
    return (sharded_strategy or TorchDistLoadShardedStrategy()).load_sharded_metadata(checkpoint_dir)


def load_plain_tensors(checkpoint_dir: str) -> StateDict:
    """Every saved tensor, whole, by its key (no common values)."""
    return load(load_tensors_metadata(checkpoint_dir), checkpoint_dir, validate_access_integrity=False)


def load_content_metadata(
    checkpoint_dir: str | None = None, *, preloaded_state_dict: StateDict | None = None
) -> dict | None:
    """What ``save(..., content_metadata=...)`` recorded (None if nothing), from the checkpoint or a
    state dict ``load`` returned."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ValueError("Both checkpoint_dir and loaded_state_dict cannot be None")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(_CONTENT_METADATA_KEY)
