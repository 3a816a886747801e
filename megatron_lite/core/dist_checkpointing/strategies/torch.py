"""megatron-core's ``torch_dist`` strategies (``dist_checkpointing.strategies.torch``) over our own
DCP planners (``planners``) and list-based save and load (``pieces``): the save strategy writes a
state dict's ShardedTensors and ShardedObjects, now or from another process (``async_save``); the load
strategy reads them back, and tells what a checkpoint holds without reading it."""

from __future__ import annotations

import io
import json
import os
import tempfile
from dataclasses import replace

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from megatron_lite.core.dist_checkpointing.core import CheckpointingException
from megatron_lite.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron_lite.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)
from megatron_lite.core.dist_checkpointing.pieces import (
    SaveRequest,
    check_data_files,
    load_metadata,
    plan_save,
    read_object_bytes,
)
from megatron_lite.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron_lite.core.dist_checkpointing.strategies.common import load_weights_only
from megatron_lite.core.dist_checkpointing.strategies.planners import ShardedLoadPlanner
from megatron_lite.core.dist_checkpointing.strategies.safe_reader import SafeFileSystemReader


def _plain(r: WriteResult) -> list:
    index, info = r.index, r.storage_data
    offset = None if index.offset is None else list(index.offset)
    return [index.fqn, offset, index.index, r.size_in_bytes] + [
        info.relative_path,
        info.offset,
        info.length,
        info.transform_descriptors,
    ]


def _write_and_record(request: SaveRequest, path: str) -> None:
    """In the writing process: this rank's files, then their write results as plain JSON."""
    plain = [_plain(r) for r in request.write()]
    with open(path, "w") as f:
        json.dump(plain, f)


def _recorded(path: str) -> list[WriteResult]:
    try:
        with open(path) as f:
            plain = json.load(f)
    finally:
        os.remove(path)
    return [
        WriteResult(MetadataIndex(fqn, offset, index), size, _StorageInfo(name, at, length, transforms))
        for fqn, offset, index, size, name, at, length, transforms in plain
    ]


def _split(sharded_state_dict: ShardedStateDict) -> tuple[list[ShardedTensor], list[ShardedObject]]:
    values = list(nested_values(sharded_state_dict))
    unknown = [v for v in values if not isinstance(v, (ShardedTensor, ShardedObject))]
    if unknown:
        raise CheckpointingException(f"cannot save or load {type(unknown[0]).__name__} as sharded")
    return [v for v in values if isinstance(v, ShardedTensor)], [
        v for v in values if isinstance(v, ShardedObject)
    ]


class TorchDistSaveShardedStrategy:
    """Saves through DCP, one file per rank. ``thread_count`` and ``cached_metadata`` are accepted for
    upstream's signature; ``separation_hint`` (files per key prefix) megatron_lite does not have."""

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 2,
        cached_metadata: bool = False,
        separation_hint: str | None = None,
    ):
        if separation_hint is not None:
            raise CheckpointingException("separation_hint is not supported by megatron_lite")
        self.backend, self.version = backend, version
        self.keep_only_main_replica = keep_only_main_replica

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> None:
        """Collective over the world."""
        tensors, objects = _split(sharded_state_dict)
        request = plan_save(tensors, str(checkpoint_dir), objects)
        request.finish(request.write())

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> AsyncRequest:
        """Plan now (collective); the returned request writes this rank's files in another process
        and, finalized, writes ``.metadata`` (collective)."""
        tensors, objects = _split(sharded_state_dict)
        # A copy on the host now: the writing process must see the values of this call, not later ones.
        tensors = [replace(t, data=t.data.detach().to("cpu", copy=True)) for t in tensors]
        request = plan_save(tensors, str(checkpoint_dir), objects)
        # DCP's write results come back through a file of this call's own, outside the checkpoint.
        handle, path = tempfile.mkstemp(prefix="megatron_lite_write_results_", suffix=".json")
        os.close(handle)
        return AsyncRequest(_write_and_record, (request, path), [lambda: request.finish(_recorded(path))])


def _load_object(checkpoint_dir: str, metadata, obj: ShardedObject):
    data = read_object_bytes(str(checkpoint_dir), metadata, obj.unique_key)
    if data is None:
        raise CheckpointingException(f"the checkpoint holds no object {obj.unique_key}")
    return load_weights_only(io.BytesIO(data))


class TorchDistLoadShardedStrategy:
    """Loads through DCP: every requested piece reads its overlap with whatever chunks were saved."""

    def __init__(self, checkpoint_name: str | None = None):
        self.checkpoint_name = checkpoint_name

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> StateDict:
        """``sharded_state_dict`` with each ShardedTensor replaced by its loaded tensor and each
        ShardedObject by its object. Collective over the world; a key the checkpoint lacks, or a
        tensor of another shape (unless it allows a mismatch: the rest is zeros), is DCP's
        CheckpointException on every rank."""
        metadata = load_metadata(str(checkpoint_dir))
        check_data_files(str(checkpoint_dir), metadata)  # a missing or cut .distcp: one exception
        tensors, objects = _split(sharded_state_dict)
        for piece in tensors:
            piece.init_data("cpu")
            piece.data = piece.data.detach()  # read in place, as upstream: a parameter's too
            if piece.allow_shape_mismatch:
                piece.data.zero_()
        reader = SafeFileSystemReader(str(checkpoint_dir), metadata)
        dcp.load({}, storage_reader=reader, planner=ShardedLoadPlanner(tensors))
        loaded = {id(o): _load_object(checkpoint_dir, metadata, o) for o in objects}
        return dict_list_map_inplace(
            lambda v: loaded[id(v)] if isinstance(v, ShardedObject) else v.data, sharded_state_dict
        )

    def load_tensors_metadata(self, checkpoint_dir: str, metadata=None) -> dict[str, ShardedTensor]:
        """Every saved tensor by its key, as one unsharded ShardedTensor without data."""
        metadata = metadata or load_metadata(str(checkpoint_dir))
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                shape, n = tuple(md.size), len(md.size)
                out[key] = ShardedTensor(key, None, md.properties.dtype, shape, shape, (0,) * n, (1,) * n)
        return out

    def load_sharded_metadata(self, checkpoint_dir: str) -> dict[str, ShardedTensor | ShardedObject]:
        """``load_tensors_metadata`` and every saved object by its unique key, without data."""
        metadata = load_metadata(str(checkpoint_dir))
        out: dict = self.load_tensors_metadata(checkpoint_dir, metadata)
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                out[key] = ShardedObject.empty_from_unique_key(key)
        return out
