"""CUDA memory history (upstream's --record-memory-history / --memory-snapshot-path).

The caching allocator records every allocation with its stack; the last rank writes the snapshot to
``--memory-snapshot-path`` at every log interval, and a rank that runs out of memory writes its own as
``oom_rank-<rank>_<name>`` beside it (upstream's names). Open them at https://pytorch.org/memory_viz.
CUDA only: without CUDA the flag is refused when the config is validated.
"""

from __future__ import annotations

import os
import pickle

import torch

from megatron_lite.utils.atomic_io import atomic_write_bytes

MAX_ENTRIES = 100_000  # allocation events kept, as upstream


def start_memory_history() -> None:
    """Begin recording this process's CUDA allocations (with their stacks)."""
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def oom_snapshot_path(memory_snapshot_path: str, rank: int) -> str:
    head, name = os.path.split(memory_snapshot_path)
    return os.path.join(head, f"oom_rank-{rank}_{name}")


def dump_memory_snapshot(path: str) -> str:
    """Write the allocator's snapshot to ``path`` atomically (a reader never sees half a pickle)."""
    snapshot = torch.cuda.memory._snapshot()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_bytes(path, lambda f: pickle.dump(snapshot, f))
    return path
