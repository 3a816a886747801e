"""``torch.distributed.checkpoint`` planners over ``ShardedTensor`` pieces and ``ShardedObject``s.

DCP writes one chunk per piece (its global offset and size) and reads, for every piece a rank asks
for, the overlap with every saved chunk: that is what makes a checkpoint loadable at another layout.
An object is stored as ``torch.save(data)``'s bytes under its ``unique_key``, as megatron-core's
planner stores it.
"""

from __future__ import annotations

import io
import math

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
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

from megatron_lite.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica


def _index(piece: ShardedTensor) -> tuple[str, tuple[int, ...]]:
    return piece.key, tuple(piece.global_offset)


def _global_rank(piece: ShardedTensor) -> torch.Tensor:
    """``piece.data`` with its prepended axes (``prepend_axis_num``) as leading axes of size 1: a view
    with as many axes as the global tensor."""
    return piece.data[(None,) * piece.prepend_axis_num]


def _serialized(data) -> bytes:
    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getvalue()


class ShardedSavePlanner(DefaultSavePlanner):
    """Writes the main replica (``is_main_replica``) of each piece and object. DCP's global plan checks
    that the pieces of every tensor tile it exactly, neither overlapping nor leaving a gap."""

    def __init__(self, pieces: list[ShardedTensor], objects: list[ShardedObject] = ()):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        main = [p for p in pieces if is_main_replica(p.replica_id)]
        self.pieces = {_index(p): _global_rank(p) for p in main}
        self.shapes = {_index(p): tuple(p.global_shape) for p in main}
        self.objects = {o.unique_key: _serialized(o.data) for o in objects if is_main_replica(o.replica_id)}

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
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.objects:
            return io.BytesIO(self.objects[index.fqn])
        return self.pieces[(index.fqn, tuple(index.offset))]

    def transform_object(self, write_item: WriteItem, object):
        return object  # an object's bytes as they are (DCP's own would pickle the io.BytesIO again)

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
    stop = tuple(min(o + s, g) for o, s, g in zip(start, _global_rank(piece).shape, saved_shape))
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
            saved = self.metadata.state_dict_metadata.get(piece.key)
            if saved is None or not hasattr(saved, "size"):
                raise KeyError(f"the checkpoint holds no tensor {piece.key}")
            if tuple(saved.size) != tuple(piece.global_shape) and not piece.allow_shape_mismatch:
                raise ValueError(
                    f"{piece.key} is {tuple(saved.size)} in the checkpoint, not {piece.global_shape}"
                )
            part = overlap(piece, tuple(saved.size))
            if part is None:
                continue
            offset, size = part
            self.targets.setdefault(piece.key, []).append(
                _global_rank(piece)[tuple(slice(0, s) for s in size)]
            )
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
