"""What a rank contributes to a distributed checkpoint (megatron-core's ``dist_checkpointing.mapping``):
a ``ShardedTensor`` is one rectangular piece of a named global tensor with its place in it, a
``ShardedObject`` one shard of a global array of pickled objects, a ``ShardedTensorFactory`` a tensor
that becomes a sub-state-dict of pieces on save and is merged back after a load. ``Slab`` and
``flat_range_pieces`` are megatron_lite's own: how a model's local parameter (or the distributed
optimizer's flat shard of it) maps onto pieces."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megatron_lite.core.dist_checkpointing.core import CheckpointingException
from megatron_lite.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron_lite.core.dist_checkpointing.slabs import Slab, flat_range_places

# Hints only: a plain state dict, and one whose tensors are replaced by ShardedBase objects.
StateDict = dict[str, Any]
CommonStateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]
ReplicaId = int | tuple[int, ...]


class ShardedBase(ABC):
    """A local value with its place in a global one: ``key`` names the global value, ``replica_id``
    says which copy this is (the main one, see ``is_main_replica``, is the one saved)."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise CheckpointingException where the metadata contradicts itself."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """A copy with ``data`` None: what ranks exchange to validate a checkpoint's layout."""


@dataclass
class ShardedTensor(ShardedBase):
    """``data`` (of ``dtype`` and ``local_shape``; None in metadata only) sits at ``global_offset`` of
    the global tensor ``key`` of ``global_shape``. ``axis_fragmentations``: how many equal chunks each
    axis is cut into, None for an irregular grid. ``prepend_axis_num``: leading global axes the local
    tensor lacks (as if unsqueezed), e.g. the stacked layers. ``allow_shape_mismatch`` (a padded
    vocabulary): a load takes the overlap with the saved tensor and leaves the rest of ``data`` as it
    is. ``flattened_range``: upstream's retired flat form, refused."""

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        def fail(why: str):
            raise CheckpointingException(f"{why} for {self}")

        if self.data is not None and self.data.dtype != self.dtype:
            fail(f"data is {self.data.dtype}, not dtype")
        if self.data is not None and tuple(self.data.shape) != tuple(self.local_shape):
            fail(f"data is {tuple(self.data.shape)}, not local_shape")
        if len(self.global_shape) != len(self.global_offset):
            fail("global_offset and global_shape have different numbers of dimensions")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            fail("local_shape with prepend_axis_num and global_shape have different numbers of dimensions")
        shape = (1,) * self.prepend_axis_num + tuple(self.local_shape)
        if any(o < 0 or o + s > g for o, s, g in zip(self.global_offset, shape, self.global_shape)):
            fail("the local tensor does not fit in the global one")  # megatron_lite's own check
        if self.axis_fragmentations is not None and any(
            s and o % s for o, s in zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
        ):
            fail("a global offset is not a multiple of the local shape on a regular grid")
        if self.flattened_range is not None:
            fail("flattened_range is not supported")

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """The local tensor's index in the global grid of chunks (prepended axes as they are)."""
        p = self.prepend_axis_num
        chunks = zip(self.global_offset[p:], self.local_shape)
        return (*self.global_offset[:p], *(o // s for o, s in chunks))

    def without_data(self) -> ShardedTensor:
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs,
    ) -> ShardedTensor:
        """``data`` as chunk ``rank`` of ``fragments`` equal chunks along ``axis`` of the global tensor,
        for each ``(axis, rank, fragments)`` in ``rank_offsets`` (axes counted with the prepended
        ones); every other axis whole."""
        if flattened_range is not None:
            raise ValueError("from_rank_offsets makes no flat ShardedTensor")
        shape = (1,) * prepend_axis_num + tuple(data.shape)
        global_shape, global_offset, fragments = list(shape), [0] * len(shape), [1] * len(shape)
        for axis, rank, n in rank_offsets:
            if axis < 0 or rank < 0 or n < 1 or rank >= n:
                raise CheckpointingException(f"Invalid rank offsets: {rank_offsets} for key {key}.")
            global_shape[axis], global_offset[axis], fragments[axis] = n * shape[axis], rank * shape[axis], n
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragments),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    def init_data(self, device: str | torch.device, init_fn=torch.empty) -> None:
        """Allocate ``data`` (only where it is None)."""
        if self.data is None:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """``torch.narrow`` of the local tensor along ``dim`` (not counting prepended axes), every rank
        alike: the global tensor shrinks by the same ratio. One piece, in a list as upstream's."""
        d, local = dim + self.prepend_axis_num, self.local_shape[dim]
        if self.global_shape[d] % local or self.global_offset[d] % local:
            raise CheckpointingException(f"narrowing needs a regular grid of local tensors, got {self}")
        data = self.data.narrow(dim, start, length)
        global_shape, global_offset = list(self.global_shape), list(self.global_offset)
        global_shape[d], global_offset[d] = (
            global_shape[d] // local * length,
            global_offset[d] // local * length,
        )
        return [
            replace(
                self,
                data=data,
                local_shape=tuple(data.shape),
                global_shape=tuple(global_shape),
                global_offset=tuple(global_offset),
            )
        ]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The copy that is saved: replica id 0, or a tuple of zeros."""
    return replica_id == 0 if isinstance(replica_id, int) else all(r == 0 for r in replica_id)


@dataclass
class ShardedObject(ShardedBase):
    """Shard ``global_offset`` of a global array (of ``global_shape``) of pickled objects; ``data`` is
    this rank's object (None in metadata only). Unlike a tensor's, its sharding cannot change."""

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"global_offset and global_shape have different numbers of dimensions for {self}"
            )

    def without_data(self) -> ShardedObject:
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offset>_<shape>``, dot-joined: the name the checkpoint stores it under."""
        offset, shape = (".".join(map(str, t)) for t in (self.global_offset, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    def __str__(self) -> str:
        return f"{type(self).__name__}(key='{self.key}')"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """The data-less object a ``unique_key`` names."""
        key, shard = unique_key.split("/")
        tag, offset, shape = shard.split("_")
        assert tag == "shard", unique_key
        offset, shape = tuple(map(int, offset.split("."))), tuple(map(int, shape.split(".")))
        if len(shape) + 1 == len(offset):  # an older key left out the last axis' size
            shape += (-1,)
        return cls(key, None, shape, offset, replica_id)


class LocalNonpersistentObject:
    """A value a save leaves out and a load puts back as this rank has it (e.g. a torch optimizer's
    ``params`` ids per group, which are this process's own)."""

    def __init__(self, obj):
        self.obj = obj

    def unwrap(self):
        return self.obj


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, slice | None], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved as the sub-state-dict ``build_fn(key, data, replica_id, flattened_range)``
    returns, and rebuilt after a load by ``merge_fn`` from that sub-state-dict, loaded (e.g. one
    parameter saved as several tensors, which optimizer states then follow)."""

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check before it is built."""

    def without_data(self) -> ShardedTensorFactory:
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Build every ShardedTensorFactory in ``sharded_state_dict``, in place."""
    dict_list_map_inplace(
        lambda x: x.build() if isinstance(x, ShardedTensorFactory) else x, sharded_state_dict
    )


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict, key: tuple = ()) -> StateDict:
    """Merge back, in ``x1`` (a loaded state dict, modified in place), every value that ``x2`` (the
    state dict before ``apply_factories``) holds a factory for; ``key``: where we are, for errors."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, list) and isinstance(x2, list) and len(x1) != len(x2):
        raise ValueError(f"Cannot merge two lists with different lengths ({len(x1)} and {len(x2)}) at {key}")
    if isinstance(x1, list) and isinstance(x2, (list, dict)):
        items = enumerate(x2) if isinstance(x2, list) else x2.items()
    elif isinstance(x1, dict) and isinstance(x2, dict):
        items = x2.items()
    else:
        raise ValueError(f"Duplicate non-dict and non-list values encountered: `{x1}` and `{x2}` (at {key})")
    for k, v2 in items:
        if isinstance(x1, dict) and k not in x1:
            raise ValueError(f"{k!r} is not in the loaded state dict (at {key})")
        if isinstance(x1, list) and not (isinstance(k, int) and 0 <= k < len(x1)):
            raise ValueError(f"{k!r} is no index of a list of length {len(x1)} (at {key})")
        x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    return x1


def flat_range_pieces(
    slabs: list[Slab], local_shape, flat: torch.Tensor, start: int, replica_id: int = 0, prefix: str = ""
) -> list[ShardedTensor]:
    """The pieces of flat elements ``[start, start + flat.numel())`` of a local tensor of
    ``local_shape`` (at most 2-D), ``flat`` holding them: the distributed optimizer's shard of a
    parameter, or a whole parameter (``start`` 0). Each is a rectangle of the global tensor; ``prefix``
    names the global tensor (``optimizer.state.exp_avg.`` ...)."""
    pieces = []
    for slab, at, shape, offset, global_shape in flat_range_places(
        slabs, local_shape, start, start + flat.numel()
    ):
        data = flat[at : at + math.prod(shape)].view(shape)
        # axis_fragmentations None: an irregular grid (partial rows, a gated fc1's two slabs).
        pieces.append(
            ShardedTensor(
                prefix + slab.key,
                data,
                data.dtype,
                tuple(shape),
                global_shape,
                offset,
                None,
                replica_id,
                allow_shape_mismatch=slab.allow_shape_mismatch,
            )
        )
    return pieces
