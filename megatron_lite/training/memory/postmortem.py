"""When a rank runs out of memory: what it held, written down before it dies.

The rank that fails an allocation (``torch.OutOfMemoryError`` on CUDA, ``MemoryError`` or the CPU
allocator's "can't allocate memory" error on the host) writes ``oom-rank<r>.json`` into the log
directory (--tensorboard-dir, else --save, else the working directory): its rank and pipeline stage,
the iteration, the error, its memory report with the attribution (weights, gradients, optimizer state,
activations, other) and the prediction for its stage. It then raises :class:`OutOfMemoryPostMortem`,
whose one line (stage and file) is what the launcher prints; the other ranks fail on the broken
connections and are stopped. Nothing here is collective: the other ranks cannot take part.
:func:`out_of_memory_postmortem` wraps pretrain()'s set-up and loop to do so.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.training.memory.predict.stages import predict_memory_per_stage
from megatron_lite.training.memory.report import report_memory
from megatron_lite.training.memory.saved_tensors import ACTIVATION_MEMORY
from megatron_lite.training.memory.snapshots import dump_memory_snapshot, oom_snapshot_path
from megatron_lite.utils.atomic_io import atomic_write_bytes

if TYPE_CHECKING:
    from megatron_lite.training.config import ConfigContainer
    from megatron_lite.training.state import GlobalState


class OutOfMemoryPostMortem(RuntimeError):
    """A rank ran out of memory; its record is at ``path``."""

    def __init__(self, rank: int, stage: int, iteration: int, path: str, error: str):
        self.rank, self.stage, self.iteration, self.path = rank, stage, iteration, path
        super().__init__(
            f"rank {rank} (pipeline stage {stage}) ran out of memory at iteration {iteration}: {error}; "
            f"post-mortem: {path}"
        )


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def short_error(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def log_directory(config) -> str:
    return config.logger.tensorboard_dir or config.checkpoint.save or os.getcwd()


def write_postmortem(config, rank: int, stage: int, dp_rank: int, iteration: int, err: BaseException) -> str:
    """Write this rank's record atomically; returns its path. ``dp_rank``: its data x context parallel
    rank (the distributed optimizer's shard, hence the prediction, depends on it)."""
    device_type = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
    prediction = asdict(predict_memory_per_stage(config, dp_rank, device_type)[stage])
    record = {
        "rank": rank,
        "pipeline_stage": stage,
        "iteration": iteration,
        "error": short_error(err),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "memory_gigabytes": report_memory(config.logger.memory_keys),
        # Untracked iterations (no memory logging, past the first console memory line) have no
        # activation or "other" figures: the saved-tensor hooks are only paid where reported.
        "activations_tracked": ACTIVATION_MEMORY.tracking,
        "prediction_bytes": {"label": "prediction", **prediction},
    }
    directory = log_directory(config)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"oom-rank{rank}.json")
    atomic_write_bytes(path, lambda f: f.write((json.dumps(record, indent=2) + "\n").encode()))
    return path


@contextlib.contextmanager
def out_of_memory_postmortem(config: ConfigContainer, state: GlobalState):
    """Turn this rank's out-of-memory error into a post-mortem file and OutOfMemoryPostMortem."""
    try:
        yield
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        stage, dp_rank = (
            (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank(True))
            if parallel_state.model_parallel_is_initialized()
            else (0, 0)
        )
        iteration = state.train_state.step + 1  # the one that was running
        p = config.profiling
        if p is not None and p.record_memory_history:
            dump_memory_snapshot(oom_snapshot_path(p.memory_snapshot_path, rank))
        path = write_postmortem(config, rank, stage, dp_rank, iteration, err)
        raise OutOfMemoryPostMortem(rank, stage, iteration, path, short_error(err)) from err
