"""Helpers for tests that need real multi-process gloo worlds or real pretrain.py jobs."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = str(REPO / "pretrain.py")

# A model small enough that a multi-process job takes seconds on two cores.
SMALL_MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--vocab-size 256 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 "
    "--log-interval 1"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, store_path, fn, args, queue):
    os.environ.update(OMP_NUM_THREADS="1")
    try:
        # A file rendezvous: no port to pick, so concurrent test runs cannot collide on one.
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank of a real gloo world; return each rank's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="megatron_lite_world_")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, store_path, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    return [results[r] for r in range(world_size)]


def run_pretrain(args: list[str], cwd, *, env: dict | None = None, timeout: float = 240.0):
    """Run ``python pretrain.py ARGS`` as a user would; returns the CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, PRETRAIN, *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|")


def parse_losses(stdout: str) -> dict[int, float]:
    """{iteration: lm loss} from Megatron's iteration lines."""
    return {int(m.group(1)): float(m.group(2)) for m in _ITERATION.finditer(stdout)}


def loss_lines(stdout: str) -> dict[int, str]:
    """{iteration: 'lm loss: ...' text} for bitwise comparisons."""
    return {int(m.group(1)): m.group(2) for m in _ITERATION.finditer(stdout)}
