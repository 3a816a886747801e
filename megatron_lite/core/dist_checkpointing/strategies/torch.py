"""``torch.distributed.checkpoint`` planners over ``ShardedTensor`` pieces, and a reader of DCP's
``.metadata`` that runs no code from the file.

DCP writes one chunk per piece (its global offset and size) and reads, for every piece a rank asks
for, the overlap with every saved chunk: that is what makes a checkpoint loadable at another layout.
DCP's own ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load``, which can run code; here
it goes through an unpickler that builds DCP's metadata classes, torch sizes and dtypes only. The
tensors themselves DCP reads with torch's weights-only unpickler.
"""

from __future__ import annotations

import math
import pickle
import re

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_lite.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

_DCP = "torch.distributed.checkpoint."
# Exactly the classes DCP's own .metadata (and megatron-core's, with its cached save plans) is made of.
_CLASSES = {
    f"{_DCP}metadata": (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ),
    f"{_DCP}filesystem": ("_StorageInfo",),
    f"{_DCP}planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "pathlib": ("PosixPath", "PurePosixPath"),  # the checkpoint_id DCP records
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler, limited to ``_CLASSES``, torch.Size, torch's dtype / layout /
    memory-format values and ``_get_layout`` (a layout by its name); BUILD (setting an object's state)
    only on instances of those classes, never on a class itself."""

    def find_class(self, module: str, name: str):
        if name in _CLASSES.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), _TORCH_VALUES)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")

    def load_build(self) -> None:
        target = self.stack[-2]  # under the state BUILD pops
        allowed = _CLASSES.get(type(target).__module__, ())
        if isinstance(target, type) or type(target).__name__ not in allowed:
            raise pickle.UnpicklingError(f"setting the state of a {type(target).__name__} is not allowed")
        super().load_build()

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build}


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, with ``.metadata`` read through ``_MetadataUnpickler`` and every data file it
    names checked to be one of this directory's ``__<rank>_<n>.distcp``; ``metadata``: what an
    earlier ``read_metadata`` returned, so a load does not read the file again."""

    def __init__(self, path, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is not None:
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
        for info in (metadata.storage_data or {}).values():
            if not _DATA_FILE.fullmatch(str(getattr(info, "relative_path", ""))):
                raise pickle.UnpicklingError(
                    f".metadata names a data file {getattr(info, 'relative_path', None)!r}"
                )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _index(piece: ShardedTensor) -> tuple[str, tuple[int, ...]]:
    return piece.key, tuple(piece.global_offset)


class ShardedSavePlanner(DefaultSavePlanner):
    """Writes the main replica (``is_main_replica``) of each piece. DCP's global plan checks that the
    pieces of every tensor tile it exactly, neither overlapping nor leaving a gap."""

    def __init__(self, pieces: list[ShardedTensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        main = [p for p in pieces if is_main_replica(p.replica_id)]
        self.pieces = {_index(p): p.data for p in main}
        self.shapes = {_index(p): tuple(p.global_shape) for p in main}

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offset), data in self.pieces.items():
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size(offset)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=data.shape),
                        properties=TensorProperties.create_from_tensor(data),
                        size=torch.Size(self.shapes[(key, offset)]),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[(index.fqn, tuple(index.offset))]

    def stage(self, buffers: dict) -> bool:
        """Copy every piece into host memory another process can read (``buffers``: views of one
        shared buffer per dtype, reused while the pieces keep their shapes), so training may change
        the originals meanwhile; then ``pieces`` holds only the indices (the writer process has the
        buffers). Returns whether the buffers are new, i.e. must be sent to the writer again."""
        layout = {index: (tuple(d.shape), d.dtype) for index, d in self.pieces.items()}
        fresh = layout != {index: (tuple(b.shape), b.dtype) for index, b in buffers.items()}
        if fresh:
            buffers.clear()
            sizes: dict = {}
            for shape, dtype in layout.values():
                sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
            flat = {dtype: torch.empty(n, dtype=dtype).share_memory_() for dtype, n in sizes.items()}
            at = dict.fromkeys(flat, 0)
            for index, (shape, dtype) in layout.items():
                n = math.prod(shape)
                buffers[index] = flat[dtype][at[dtype] : at[dtype] + n].view(shape)
                at[dtype] += n
        for index, data in self.pieces.items():
            buffers[index].copy_(data)
        self.pieces = dict.fromkeys(self.pieces)
        return fresh

    def attach(self, buffers: dict) -> None:
        """In the writer process: the staged buffers behind ``pieces``' indices."""
        self.pieces = {index: buffers[index] for index in self.pieces}


def overlap(piece: ShardedTensor, saved_shape) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The part of ``piece`` (global offset, size) inside a saved tensor of ``saved_shape``; None when
    it has none."""
    start = tuple(piece.global_offset)
    stop = tuple(min(o + s, g) for o, s, g in zip(start, piece.data.shape, saved_shape))
    if any(b <= a for a, b in zip(start, stop)):
        return None
    return start, tuple(b - a for a, b in zip(start, stop))


class ShardedLoadPlanner(LoadPlanner):
    """Reads every piece (every replica) in place from whatever chunks the checkpoint holds. The
    caller has checked that each key is saved, with this global shape unless it allows a mismatch.
    Each piece is its own local chunk of its key (DCP's read items name it by its position in the
    key's list), so pieces that overlap, such as a weight and its fp32 main copy, each get read."""

    def __init__(self, pieces: list[ShardedTensor]):
        self.pieces = pieces
        self.targets: dict[str, list[torch.Tensor]] = {}

    def set_up_planner(self, state_dict=None, metadata: Metadata | None = None, is_coordinator=False) -> None:
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        chunks: dict[str, list[ChunkStorageMetadata]] = {}
        for piece in self.pieces:
            part = overlap(piece, tuple(self.metadata.state_dict_metadata[piece.key].size))
            if part is None:
                continue
            offset, size = part
            self.targets.setdefault(piece.key, []).append(piece.data[tuple(slice(0, s) for s in size)])
            chunks.setdefault(piece.key, []).append(
                ChunkStorageMetadata(torch.Size(offset), torch.Size(size))
            )
        items = []
        for key, local in chunks.items():
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], local)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"{read_item.dest_index.fqn}: megatron_lite reads tensors only from a checkpoint")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        target = self.targets[read_item.dest_index.fqn][read_item.dest_index.index]
        return target[tuple(slice(o, o + n) for o, n in zip(read_item.dest_offsets, read_item.lengths))]

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # read in place
