"""Writing a checkpoint directory atomically, whatever its format: every rank writes into a temporary
directory, rank 0 renames it into place once all are on disk and replaces the tracker last. A crash or
a failed write mid-save leaves the previous checkpoint and tracker untouched."""

from __future__ import annotations

import json
import os
import shutil
import time

import torch.distributed as dist

from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.layout import CHECKPOINT_VERSION, METADATA, TRACKER, parallel_layout
from megatron_lite.utils.atomic_io import atomic_write_bytes, replace_directory, write_error_line

# Fault-injection tests widen the window between writing the shards and committing them.
_TEST_DELAY_BEFORE_COMMIT_S = float(os.environ.get("MEGATRON_LITE_TEST_SAVE_DELAY_S", "0"))


def _commit(root: str, tmp_root: str, iteration: int) -> None:
    """Rank 0: rename the complete save into place; a failure puts back what was there."""
    replace_directory(tmp_root, os.path.join(root, f"iter_{iteration:07d}"))


def save_error(flag: str, root: str, iteration: int, err: Exception) -> str:
    reason = (
        write_error_line(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}".splitlines()[0]
    )
    return f"{flag} {root}: iteration {iteration} not saved, {reason}; the previous checkpoint and {TRACKER} are untouched"


def begin_checkpoint(root: str, iteration: int, flag: str = "--save") -> str:
    """Rank 0 clears leftovers of killed saves and makes the temporary directory every rank writes
    into; returns its path. Collective over the world (one rank's failure is every rank's error)."""
    tmp_root = os.path.join(root, f".tmp_iter_{iteration:07d}")
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            for name in os.listdir(root):  # leftovers of saves that were killed part-way
                if name.startswith(".tmp_iter_") or name.endswith(".old"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.makedirs(tmp_root)
        except OSError as err:
            error = save_error(flag, root, iteration, err)
    agree(error)
    return tmp_root


def end_checkpoint(
    root: str,
    iteration: int,
    tmp_root: str,
    error: str | None,
    flag: str = "--save",
    metadata: dict | None = None,
) -> None:
    """After every rank wrote into ``tmp_root`` (``error``: this rank's failure, if any): rank 0 adds
    ``metadata.json`` (``metadata``, else the legacy format's layout record), renames the directory
    into place and replaces the tracker last. Collective over the world; any rank's failure is one
    CheckpointError on every rank, the partial save removed, the previous checkpoint untouched."""
    if dist.get_rank() == 0 and error is None:
        if metadata is None:
            metadata = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION, **parallel_layout()}
        try:
            text = json.dumps(metadata)
            atomic_write_bytes(os.path.join(tmp_root, METADATA), lambda f: f.write(text.encode()))
        except OSError as err:
            error = save_error(flag, root, iteration, err)
    if _TEST_DELAY_BEFORE_COMMIT_S:
        time.sleep(_TEST_DELAY_BEFORE_COMMIT_S)
    agree(error, cleanup=tmp_root)
    if dist.get_rank() == 0:
        try:
            _commit(root, tmp_root, iteration)
        except OSError as err:
            shutil.rmtree(tmp_root, ignore_errors=True)
            error = save_error(flag, root, iteration, err)
        else:
            try:
                atomic_write_bytes(os.path.join(root, TRACKER), lambda f: f.write(f"{iteration}\n".encode()))
            except OSError as err:
                error = (
                    f"{flag} {root}: iteration {iteration} is on disk but {TRACKER} was not updated, "
                    f"{write_error_line(err)}; it still names the previous checkpoint"
                )
    agree(error)


def write_checkpoint(root: str, iteration: int, write_shards, flag: str = "--save", metadata=None) -> None:
    """Iteration ``iteration`` of ``root``, atomically: ``write_shards(tmp_root)`` (called on every rank,
    may run collectives) writes each rank's files into a temporary directory, then ``end_checkpoint``
    commits it. Collective over the world; a write that fails on any rank (a full disk, a quota, an
    I/O error) is one CheckpointError on every rank, with the partial save removed and the previous
    checkpoint and tracker untouched."""
    tmp_root = begin_checkpoint(root, iteration, flag)
    error = None
    try:
        write_shards(tmp_root)
    except Exception as err:  # a full disk, or anything else: the other ranks must hear of it, not wait
        error = save_error(flag, root, iteration, err)
    end_checkpoint(root, iteration, tmp_root, error, flag, metadata)
