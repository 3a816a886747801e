"""``--async-save``: a ``torch_dist`` save whose tensors are written by a background process while
training goes on (Megatron-LM's ``schedule_async_save`` / ``maybe_finalize_async_save``).

At the save the tensors are copied to shared host memory and handed to this rank's writer process.
After every iteration ``finalize_async_save`` asks all ranks (one small all-reduce, only while a save
is in flight) whether their writes are done; once all are, the coordinator writes DCP's ``.metadata``
and the checkpoint is committed as any other (``commit.end_checkpoint``: renamed into place, the
tracker moved last). A crash before that leaves the previous checkpoint as the latest; the next
save, and the end of training, first wait for the one in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.dist_checkpointing.strategies.background_writer import AsyncWriter
from megatron_lite.core.utils import get_collective_device
from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.commit import end_checkpoint, save_error


class _AsyncSaves:
    """This process's writer and the save in flight: ``(request, (root, iteration, tmp_root),
    metadata)`` and, once this rank's write ended, its outcome."""

    def __init__(self):
        self.writer = AsyncWriter()
        self.pending = None
        self.outcome = None

    def schedule(self, request, commit: tuple, metadata: dict) -> None:
        self.writer.submit(request)
        self.pending, self.outcome = (request, commit, metadata), None


_SAVES: _AsyncSaves | None = None


def finish_save(request, results: list, root: str, iteration: int) -> str | None:
    """``request.finish`` (collective: the coordinator writes DCP's ``.metadata``); its failure as the
    error line ``end_checkpoint`` agrees on."""
    try:
        request.finish(results)
    except Exception as err:
        return save_error("--save", root, iteration, err)
    return None


def async_writer() -> _AsyncSaves:
    global _SAVES
    if _SAVES is None:
        _SAVES = _AsyncSaves()
    return _SAVES


def start_async_writer() -> None:
    """Start this rank's background writer before training, so its start-up (importing torch) is not
    paid by the iterations after the first save (Megatron-LM's persistent checkpoint worker)."""
    async_writer().writer.start()


def finalize_async_save(blocking: bool = False) -> None:
    """Commit the save in flight once every rank's write is done (with ``blocking``, wait for it).
    Collective over the world whenever a save is in flight (every rank scheduled it at the same
    iteration); nothing otherwise. A write that failed on any rank is one CheckpointError on all."""
    saves = _SAVES
    if saves is None or saves.pending is None:
        return
    if saves.outcome is None:
        saves.outcome = saves.writer.poll(None if blocking else 0.0)
    done = torch.tensor([0 if saves.outcome is None else 1], device=get_collective_device())
    dist.all_reduce(done, op=dist.ReduceOp.MIN)
    if not done.item():
        return
    (request, (root, iteration, tmp_root), metadata), (status, value) = saves.pending, saves.outcome
    saves.pending = saves.outcome = None
    error = None
    if status != "done":
        error = (
            f"--save {root}: iteration {iteration} not saved, {value}; the previous checkpoint is untouched"
        )
    agree(error, cleanup=tmp_root)
    end_checkpoint(root, iteration, tmp_root, finish_save(request, value, root, iteration), metadata=metadata)
    if dist.get_rank() == 0:
        print(f" successfully saved checkpoint from iteration {iteration:7d} to {root}", flush=True)


def close_async_writer() -> None:
    """Stop this process's background writer (at exit; a save still in flight is abandoned and its
    temporary directory removed by the next save)."""
    global _SAVES
    if _SAVES is not None:
        _SAVES.writer.close()
        _SAVES = None
