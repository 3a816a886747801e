#!/usr/bin/env python
"""Iteration time while an ``--async-save`` checkpoint is being written, next to no saving and a
synchronous ``torch_dist`` save (CPU, gloo).

    python bench/async_checkpoint.py [--iters 18 --save-interval 6 --tp 1 --pp 1 --threads 1 --repeats 2]

Runs pretrain.py three times, each in a fresh temporary directory: without --save, with
``--save --ckpt-format torch_dist`` and with ``--async-save`` too (``--repeats`` runs the three again,
interleaved, and pools what they measure). From rank 0's log (``--log-interval 1``; the elapsed time of
iteration N+1 spans the save scheduled after iteration N) it prints the median iteration time without
saving (first two skipped); per save, the synchronous save's iteration and its excess; for the async
save the iteration that schedules it (common.pt, plan, copy into shared memory), the iterations logged
while the write is in flight (between the saving line and the successfully-saved line) and the one
that commits it (a write longer than the save interval makes the next save wait for it, in its
scheduling iteration). ``undisturbed`` is the median of the run's other iterations: the same run's own
baseline, which shows how much the machine's load drifted between runs. ``--threads`` sets
OMP_NUM_THREADS per rank; the default leaves a core per rank for its background writer.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EVENT = re.compile(
    r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)"
    r"|(saving) checkpoint at iteration\s+(\d+) "
    r"|successfully (saved) checkpoint from iteration\s+(\d+) "
)
WARMUP = 2


def run(mode: str, args) -> tuple[list[tuple], int]:
    """pretrain.py's events, in log order: ("iter", n, ms), ("saving", n), ("saved", n); and the bytes
    of the first checkpoint directory (0 without --save)."""
    flags = []
    if mode != "none":
        flags = ["--save", "ckpt", "--save-interval", str(args.save_interval), "--ckpt-format", "torch_dist"]
        flags += ["--async-save"] if mode == "async" else []
    world = args.tp * args.pp
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            os.path.join(REPO, "pretrain.py"),
            *f"--num-layers {args.layers} --hidden-size {args.hidden_size} --num-attention-heads 8 "
            f"--seq-length {args.seq_length} --max-position-embeddings {args.seq_length} "
            f"--vocab-size {args.vocab_size} --micro-batch-size 1 --global-batch-size 1 "
            f"--train-iters {args.iters} --log-interval 1 --tensor-model-parallel-size {args.tp} "
            f"--pipeline-model-parallel-size {args.pp} --nproc-per-node {world}".split(),
            *flags,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env)
        if proc.returncode:
            sys.exit(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        first = os.path.join(tmp, "ckpt", f"iter_{args.save_interval:07d}")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(first) for f in fs)
    events = []
    for it, ms, saving, n1, _, n2 in EVENT.findall(proc.stdout):
        if it:
            events.append(("iter", int(it), float(ms)))
        else:
            events.append(("saving" if saving else "saved", int(n1 or n2)))
    return events, size


def saves(events: list[tuple]) -> list[dict]:
    """Per save followed by an iteration: the iteration after it (which pays for the save or its
    scheduling), the iterations logged before it was committed, and the one after (the commit). The
    saving line (rank 0) may come out before or after its iteration's (the last rank's): only the
    iteration numbers and the successfully-saved line, an iteration later, are relied on."""
    times = {e[1]: e[2] for e in events if e[0] == "iter"}
    found = []
    for n in [e[1] for e in events if e[0] == "saving" and e[1] + 1 in times]:
        end = events.index(("saved", n)) if ("saved", n) in events else len(events)
        logged = sorted(e[1] for e in events[:end] if e[0] == "iter" and e[1] > n)
        commit = logged[-1] + 1 if logged else n + 1
        found.append({"at": n, "logged": logged, "flight": logged[1:], "commit": commit})
    return found


def undisturbed(events: list[tuple], found: list[dict]) -> list[float]:
    """The run's iteration times (after warm-up) that neither save, schedule, overlap nor commit."""
    busy = {s["at"] + 1 for s in found} | {s["commit"] for s in found}
    busy |= {n for s in found for n in s["logged"]}
    return [e[2] for e in events if e[0] == "iter" and e[1] > WARMUP and e[1] not in busy]


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:.0f}" for v in values) if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=18)
    parser.add_argument("--save-interval", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--threads", type=int, help="per rank (default: leave one core per rank free)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.threads = args.threads or max(1, (os.cpu_count() or 2) // (args.tp * args.pp) - 1)
    runs = {"none": [], "sync": [], "async": []}
    size = 0
    for _ in range(args.repeats):
        for mode in runs:
            events, bytes_ = run(mode, args)
            runs[mode].append((events, saves(events)))
            size = max(size, bytes_)
    base_times = [e[2] for events, _ in runs["none"] for e in events if e[0] == "iter" and e[1] > WARMUP]
    base = statistics.median(base_times)
    print(
        f"world {args.tp * args.pp} (tp {args.tp}, pp {args.pp}), OMP_NUM_THREADS {args.threads}, "
        f"{args.iters} iterations, save every {args.save_interval}, {args.repeats} repeat(s), "
        f"checkpoint {size / 1e6:.1f} MB on disk"
    )
    print(
        f"baseline (no --save): median {base:.0f} ms/iteration over {len(base_times)} iterations (> {WARMUP})\n"
    )
    print(f"{'run':<8} {'save':>4} {'its iteration ms (excess)':>26} {'in flight: iterations':>22} "
          f"{'ms each':>16} {'commit ms':>10} {'undisturbed ms':>15}")  # fmt: skip
    flight_all, schedule_excess, sync_excess, async_quiet = [], [], [], []
    for mode in runs:
        for r, (events, found) in enumerate(runs[mode]):
            times = {e[1]: e[2] for e in events if e[0] == "iter"}
            quiet = undisturbed(events, found)
            async_quiet += quiet if mode == "async" else []
            label = f"{mode}#{r + 1}"
            if mode == "none":
                print(
                    f"{label:<8} {'-':>4} {'-':>26} {'-':>22} {'-':>16} {'-':>10} {statistics.median(quiet):>15.0f}"
                )
            for s in found:
                ms = times[s["at"] + 1]
                (sync_excess if mode == "sync" else schedule_excess).append(ms - base)
                flight = [times[n] for n in s["flight"]]
                flight_all += flight
                span = f"{s['flight'][0]}-{s['flight'][-1]}" if flight else "-"
                span = f"{span} ({len(s['logged'])} overlapped)" if mode == "async" else "-"
                commit = f"{times[s['commit']]:.0f}" if mode == "async" and s["commit"] in times else "-"
                print(
                    f"{label:<8} {s['at']:>4} {f'{ms:.0f} ({ms - base:+.0f})':>26} {span:>22} "
                    f"{fmt(flight):>16} {commit:>10} {f'{statistics.median(quiet):.0f}' if quiet else '-':>15}"
                )
    print()
    if sync_excess:
        print(
            f"sync save iteration: median excess {statistics.median(sync_excess):+.0f} ms over the baseline"
        )
    if schedule_excess:
        print(f"async scheduling iteration: median excess {statistics.median(schedule_excess):+.0f} ms")
    if flight_all:
        flight_ms = statistics.median(flight_all)
        own = (
            f", {flight_ms / statistics.median(async_quiet):.2f} vs the async runs' undisturbed"
            if async_quiet
            else ""
        )
        print(
            f"in-flight iteration time / baseline: {flight_ms / base:.2f} "
            f"({flight_ms:.0f} ms median over {len(flight_all)} iterations vs {base:.0f} ms{own})"
        )
    else:
        print("in-flight iteration time / baseline: - (every write ended within its scheduling iteration)")


if __name__ == "__main__":
    main()
