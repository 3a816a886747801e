"""Saving and loading lists of ``ShardedTensor`` pieces as a DCP checkpoint: megatron_lite's own
interface, which the ``torch_dist`` checkpoint format and megatron-core's ``save`` / ``load``
(``serialization``) are built on.

A save is three steps, so that the writing may happen in another process while training goes on
(``strategies.background_writer``): ``plan_save`` (collective: every rank's pieces are planned together, the
coordinator checks they tile each tensor), ``SaveRequest.write`` (no collective: this rank's files)
and ``SaveRequest.finish`` (collective: the coordinator writes ``.metadata``, which is what makes the
directory a checkpoint). ``save_pieces`` runs the three in a row.
"""

from __future__ import annotations

import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from megatron_lite.core.dist_checkpointing.core import CheckpointingException
from megatron_lite.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron_lite.core.dist_checkpointing.strategies.planners import ShardedLoadPlanner, ShardedSavePlanner
from megatron_lite.core.dist_checkpointing.strategies.safe_reader import SafeFileSystemReader


class SaveRequest:
    """One rank's share of a planned save: the pieces (``planner``), where they go (``writer``), this
    rank's part of the global plan, and on the coordinator the metadata to write last."""

    def __init__(self, planner: ShardedSavePlanner, writer: FileSystemWriter, plan, metadata):
        self.planner, self.writer, self.plan, self.metadata = planner, writer, plan, metadata

    def write(self) -> list:
        """Write this rank's files; returns DCP's write results for ``finish``. No collective."""
        future = self.writer.write_data(self.plan, self.planner)
        future.wait()
        return future.value()

    def finish(self, results: list) -> None:
        """Gather every rank's write results; the coordinator writes ``.metadata``. Collective over the
        world."""
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(results, gathered, dst=0)
        if dist.get_rank() == 0:
            self.writer.finish(self.metadata, gathered)


def plan_save(
    pieces: list[ShardedTensor], checkpoint_dir: str, objects: list[ShardedObject] = ()
) -> SaveRequest:
    """Plan the save of every rank's ``pieces`` (and ``objects``) into ``checkpoint_dir`` (which must
    exist). Collective over the world; any rank's failure (pieces that do not tile a tensor, among
    others) raises the same CheckpointingException on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    planner = ShardedSavePlanner(pieces, objects)
    writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=True, sync_files=True)
    local, error = None, None
    try:
        planner.set_up_planner(is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as err:  # carried to the coordinator, so that no rank waits for this one
        error = f"rank {rank}: {type(err).__name__}: {err}".splitlines()[0]
    plans = [None] * world if rank == 0 else None
    dist.gather_object((local, error), plans, dst=0)
    metadata, mine = None, [None]
    if rank == 0:
        error = next((e for _, e in plans if e), None)
        plans = [p for p, _ in plans]
        if error is None:
            try:
                plans, metadata = planner.create_global_plan(plans)
                plans = writer.prepare_global_plan(plans)
            except Exception as err:  # e.g. pieces that do not tile a tensor
                error = f"{type(err).__name__}: {err}".splitlines()[0]
        if error:
            plans = [None] * world
    dist.scatter_object_list(mine, [(p, error) for p in plans] if rank == 0 else None, src=0)
    plan, error = mine[0]
    if error:
        raise CheckpointingException(error)
    return SaveRequest(planner, writer, planner.finish_plan(plan), metadata)


def save_pieces(pieces: list[ShardedTensor], checkpoint_dir: str) -> None:
    """Plan, write and finish at once. Collective over the world."""
    request = plan_save(pieces, checkpoint_dir)
    request.finish(request.write())


def load_metadata(checkpoint_dir: str) -> Metadata:
    """DCP's ``.metadata`` of ``checkpoint_dir``, read without running code from it."""
    return SafeFileSystemReader(checkpoint_dir).read_metadata()


def read_object_bytes(checkpoint_dir: str, metadata: Metadata, key: str) -> bytes | None:
    """The bytes DCP stored for the object ``key`` (a megatron-core ShardedObject's unique key, as
    ``common_state/shard_0_1``), read from its data file as they are: DCP's own load would unpickle
    them without the weights-only guard. None when the checkpoint holds no such object."""
    if not isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
        return None
    infos = [info for index, info in (metadata.storage_data or {}).items() if index.fqn == key]
    if len(infos) != 1 or getattr(infos[0], "transform_descriptors", None):
        raise CheckpointingException(f"{key} is stored in a form megatron_lite does not read")
    info = infos[0]
    with open(os.path.join(checkpoint_dir, info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length:
        raise CheckpointingException(f"{info.relative_path} is cut short")
    return data


def missing_or_mismatched(pieces: list[ShardedTensor], metadata: Metadata) -> list[str]:
    """What the checkpoint lacks for ``pieces``: keys it does not hold as tensors, and tensors of another
    global shape (unless the piece allows a mismatch)."""
    problems, saved = [], metadata.state_dict_metadata
    for piece in pieces:
        md = saved.get(piece.key)
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"no {piece.key}")
        elif tuple(md.size) != tuple(piece.global_shape) and not piece.allow_shape_mismatch:
            problems.append(f"{piece.key} is {tuple(md.size)}, not {tuple(piece.global_shape)}")
    return list(dict.fromkeys(problems))


def check_data_files(checkpoint_dir: str, metadata: Metadata) -> None:
    """Every data file ``metadata`` names is there and long enough for what it places in it: a missing
    or cut ``.distcp`` is one CheckpointingException naming it, before DCP's read would fail inside its
    collective (with a traceback per rank)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        try:
            have = os.path.getsize(os.path.join(checkpoint_dir, name))
        except OSError:
            raise CheckpointingException(f"{name} is missing; the checkpoint is damaged") from None
        if have < size:
            raise CheckpointingException(
                f"{name} is cut short ({have} of {size} bytes); the checkpoint is damaged"
            )


def _first_failure(err: CheckpointException) -> str:
    """DCP's exception (a BaseException, one traceback per rank) as the first rank's error, one line."""
    for exc, _trace in err.failures.values():
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return "an unknown failure"


def load_pieces(pieces: list[ShardedTensor], checkpoint_dir: str, metadata: Metadata | None = None) -> None:
    """Read every piece in place. Collective over the world; the caller has checked
    ``missing_or_mismatched`` and ``check_data_files`` first, on every rank before any collective
    (against ``metadata``, reused here when given). DCP's own failure is a CheckpointingException
    (one line)."""
    reader = SafeFileSystemReader(checkpoint_dir, metadata)
    try:
        dcp.load({}, storage_reader=reader, planner=ShardedLoadPlanner(pieces))
    except CheckpointException as err:
        raise CheckpointingException(_first_failure(err)) from None
