#!/usr/bin/env python
"""What pipeline-true memory logging costs.

    python bench/memory_logging_overhead.py [--iters 20] [--pairs 3]

1. End to end: `pretrain.py --pipeline-model-parallel-size 4` (the demo model, CPU), alternated in
   rounds; median elapsed time per iteration from the iteration lines (first two iterations skipped,
   where the memory trackers always run):
   - a reported iteration: TensorBoard every iteration, with and without `--log-memory-to-tensorboard`
     (with it, every iteration runs the saved-tensor and allocated-bytes trackers and the collective);
   - an unreported iteration: TensorBoard every 10 iterations, with and without memory logging, timed
     on the iterations that are not logged (no tracker, no collective: within noise of none).
2. The pieces, in a 4-process gloo world: report_memory(), the one bulk float64 MAX all-reduce of the
   whole report, and the alternative of one all-reduce per key.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from megatron_lite.training.utils.train_utils import (  # noqa: E402
    ACTIVATION_MEMORY_KEYS,
    CUDA_EXTRA_MEMORY_KEYS,
    MEMORY_KEYS,
    reduce_max_memory_across_pp_group,
    report_memory,
)

ELAPSED = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")
PP, REPS = 4, 200


def iteration_ms(extra: list[str], iters: int, unreported_of: int | None = None) -> float:
    """Median ms per iteration after the first two; with ``unreported_of`` N only the iterations that
    are not multiples of N (the unlogged ones)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [
                sys.executable,
                os.path.join(REPO, "pretrain.py"),
                "--pipeline-model-parallel-size",
                str(PP),
                "--train-iters",
                str(iters),
                *extra,
            ],
            cwd=tmp,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    times = [
        float(ms)
        for it, ms in ELAPSED.findall(out)
        if int(it) > 2 and (unreported_of is None or int(it) % unreported_of)
    ]
    return statistics.median(times)


def pieces(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=PP)
    group = dist.new_group(list(range(PP)))
    timings = {}
    start = time.perf_counter()
    for _ in range(REPS):
        report_memory()
    timings["report_memory()"] = (time.perf_counter() - start) / REPS
    # This machine's CPU report, and one shaped like a CUDA run's default report: upstream's
    # MEMORY_KEYS plus our extras (mem-ooms, activation keys).
    cuda_keys = {**MEMORY_KEYS, **CUDA_EXTRA_MEMORY_KEYS, **ACTIVATION_MEMORY_KEYS}
    cuda_shaped = {
        name.replace("bytes", "gigabytes") if "bytes" in key else name: float(i)
        for i, (key, name) in enumerate(cuda_keys.items())
    }
    for label, report in (("cpu", report_memory()), ("cuda-shaped", cuda_shaped)):

        def per_key(r=report):
            for value in r.values():
                dist.all_reduce(
                    torch.tensor([float(value)], dtype=torch.float64), op=dist.ReduceOp.MAX, group=group
                )

        for name, fn in (
            ("bulk", lambda r=report: reduce_max_memory_across_pp_group(r, group)),
            ("per-key", per_key),
        ):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(REPS):
                fn()
            timings[(label, len(report), name)] = (time.perf_counter() - start) / REPS
    queue.put((rank, timings))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()

    every = ["--log-interval", "1", "--tensorboard-dir", "tb", "--tensorboard-log-interval", "1"]
    tenth = ["--log-interval", "1", "--tensorboard-dir", "tb", "--tensorboard-log-interval", "10"]
    memory = ["--log-memory-to-tensorboard"]
    runs = {"reported": ([], []), "unreported": ([], [])}
    for _ in range(args.pairs):
        # Alternated, so drift on the machine falls on both sides of each ratio.
        runs["reported"][0].append(iteration_ms(every, args.iters))
        runs["reported"][1].append(iteration_ms([*every, *memory], args.iters))
        runs["unreported"][0].append(iteration_ms(tenth, args.iters, unreported_of=10))
        runs["unreported"][1].append(iteration_ms([*tenth, *memory], args.iters, unreported_of=10))
    print(f"pp {PP}, CPU, demo model, {args.iters} iterations x {args.pairs} alternated rounds")
    for kind, (without, with_memory) in runs.items():
        off, on = statistics.median(without), statistics.median(with_memory)
        spread = max(without) / min(without)
        print(
            f"  a {kind:<10} iteration: {off:8.1f} ms without memory logging, {on:8.1f} ms with it: "
            f"ratio {on / off:.4f} (without's own max/min over rounds: {spread:.4f})"
        )
    base = statistics.median(runs["reported"][0])

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=pieces, args=(r, port, queue)) for r in range(PP)]
    for p in procs:
        p.start()
    rank, timings = max(queue.get(timeout=600) for _ in range(PP))
    for p in procs:
        p.join()
    print(f"pieces, {PP}-rank gloo group on this machine, mean of {REPS} calls (rank {rank}):")
    report_cost = timings.pop("report_memory()")
    print(f"  report_memory(): {report_cost * 1e6:.1f} us")
    for label, keys in sorted({(k[0], k[1]) for k in timings}):
        bulk, per_key = timings[(label, keys, "bulk")], timings[(label, keys, "per-key")]
        print(
            f"  {keys:2d}-key {label:<11} report: one bulk all-reduce {bulk * 1e6:8.1f} us | one all-reduce per key "
            f"{per_key * 1e6:8.1f} us | per-key / bulk {per_key / bulk:.2f}x"
        )
    cpu_bulk = next(v for k, v in timings.items() if k[0] == "cpu" and k[2] == "bulk")
    added = cpu_bulk + report_cost
    print(
        f"  added per logged step (report + bulk all-reduce): {added * 1e3:.3f} ms = "
        f"{100 * added * 1e3 / base:.3f}% of an iteration"
    )


if __name__ == "__main__":
    main()
