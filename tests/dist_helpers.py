"""Helpers for tests that need real multi-process gloo worlds or real pretrain.py jobs."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from multiprocessing import reduction
from pathlib import Path

import torch
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

# A small MoE job (4 ranks: ep 2 x pp 2, all-to-all dispatch, grouped GEMM) for the MoE memory tests.
SMALL_MOE_JOB = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--vocab-size 256 --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --train-iters 2 --log-interval 1 "
    "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --expert-model-parallel-size 2 "
    "--pipeline-model-parallel-size 2 --nproc-per-node 4 --moe-token-dispatcher-type alltoall --moe-grouped-gemm"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks are forked from one server process that has imported torch and the framework once for the whole
# session, instead of each spawned rank importing them again (seconds per rank on two cores).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron_lite.training.pretrain",
    "megatron_lite.core.pipeline_parallel",
    "megatron_lite.training.arguments",
    "megatron_lite.training.gpt_step",
    "megatron_lite.training.checkpointing",
    "torch.utils.tensorboard",
    "wandb",
    # The bridge (and transformers with it): checkpoint_conversion.py, the recipes' runner, and jobs that
    # read a Hugging Face tokenizer or model directory, seconds each to import afresh.
    "megatron_lite.bridge",
    "megatron_lite.recipes.runner",
    "megatron.core",  # the dev extra's oracle, imported by the ranks of the interchange tests
]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _ParentFd:
    """The caller's file descriptor, sent to a forked rank with the process (as a spawned rank
    inherits it), so a rank's output lands where the caller's does (pytest's capfd included)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _ParentFd._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(dup) -> int:
        return dup.detach()


def _entry(rank, world_size, store_path, fn, args, queue, stdout_fd, stderr_fd):
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.environ.update(OMP_NUM_THREADS="1")
    # OpenMP read OMP_NUM_THREADS when the server imported torch; one thread per rank, as spawned ranks had.
    torch.set_num_threads(1)
    try:
        # A file rendezvous: no port to pick, so concurrent test runs cannot collide on one.
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        # Plain pickle: tensors travel as bytes. The queue's own pickler would pass their storage as
        # a file descriptor that the parent fetches from this process, which may have exited by then.
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank of a real gloo world; return each rank's result."""
    ctx = _context()
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="megatron_lite_world_")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, store_path, fn, args, queue, _ParentFd(1), _ParentFd(2)),
        )
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
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    return [results[r] for r in range(world_size)]


def _script_main(script: str, args: list[str], cwd: str, env: dict, out_path: str, err_path: str) -> None:
    """In a process forked from the server: what ``python SCRIPT ARGS`` does, run as ``__main__``."""
    for path, fd in ((out_path, 1), (err_path, 2)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as the interpreter puts it first
    # A process the forkserver starts makes "forkserver" its default start method; a fresh interpreter
    # has the platform's (fork on Linux). Without this, a DataLoader's workers would start a new server
    # per rank that imports torch again: seconds per job on two cores.
    multiprocessing.set_start_method(None, force=True)
    code = 1
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:  # as the interpreter does: an int is the status, anything else printed
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()  # as the interpreter does, exit status 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_script(script, args: list[str], cwd, *, env: dict | None = None, timeout: float = 240.0):
    """Run ``python SCRIPT ARGS`` as a user would (its own process, its own cwd, environment and
    output); returns a CompletedProcess. The process is forked from the preloaded server rather than
    started afresh, which saves each job the import of torch and the framework."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    full_env.update(env or {})
    script = str(script)
    with tempfile.TemporaryDirectory(prefix="megatron_lite_run_") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = _context().Process(
            target=_script_main, args=(script, args, str(cwd), full_env, out_path, err_path)
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()  # its workers die with it (the launcher sets their parent-death signal)
            proc.join()
            raise subprocess.TimeoutExpired([script, *args], timeout)
        stdout, stderr = (Path(p).read_text(errors="replace") for p in (out_path, err_path))
    return subprocess.CompletedProcess([sys.executable, script, *args], proc.exitcode, stdout, stderr)


def ok(result):
    """``result`` (a CompletedProcess), asserted to have succeeded."""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    return result


def run_pretrain(args: list[str], cwd, *, env: dict | None = None, timeout: float = 240.0):
    """``python pretrain.py ARGS`` through ``run_script``."""
    return run_script(PRETRAIN, args, cwd, env=env, timeout=timeout)


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|")


def parse_losses(stdout: str) -> dict[int, float]:
    """{iteration: lm loss} from Megatron's iteration lines."""
    return {int(m.group(1)): float(m.group(2)) for m in _ITERATION.finditer(stdout)}


def loss_lines(stdout: str) -> dict[int, str]:
    """{iteration: 'lm loss: ...' text} for bitwise comparisons."""
    return {int(m.group(1)): m.group(2) for m in _ITERATION.finditer(stdout)}
