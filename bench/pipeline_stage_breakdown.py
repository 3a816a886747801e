#!/usr/bin/env python
"""Where each pipeline stage's milliseconds go, per training iteration of a real pretrain.py job.

    python bench/pipeline_stage_breakdown.py [--skip N] [pretrain.py flags ...]

Runs pretrain.py's own workers (same launcher, same thread settings) with wall-clock timers wrapped
around the training loop's parts on every rank, and prints, per stage, the median ms per iteration
(after ``--skip`` warm-up iterations, default 3) spent in: forward compute (batch reading shown on its
own), backward compute, p2p (posting and waiting on the neighbour's exchange: the pipeline bubble
shows here), grad sync (finalize_model_grads: DP / embedding all-reduces), optimizer (its grad-norm
all-reduce wait, clipping and the AdamW update separately), logging (training_log, the loss
all-reduce) and other (the iteration's remainder: the loop, zeroing the grad buffers, the activation
tracker, the scheduler); and the process CPU time per iteration (beside the wall time: a
stage's share of the cores), split by the OS's counters (getrusage) into the training thread's CPU,
the other threads' (gloo's transport loops) and the kernel's, with the page faults, blocking waits and
preemptions each iteration costs (``--pipeline-model-parallel-size 1`` prints the same for one
process). Only pretrain.py's functions are wrapped; nothing else changes. Runs the issue's model (8 layers, hidden 256, 8 heads, seq 128, micro-batch 2, global batch 16, vocab 8192, pp 4,
fp32, 12 iterations) with the given flags appended: a later flag wins, so
``--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 1`` shows another split.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 128 "
    "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 16 --vocab-size 8192 "
    "--pipeline-model-parallel-size 4 --train-iters 12 --log-interval 1"
).split()
OUT_ENV = "MEGATRON_LITE_BREAKDOWN_DIR"
# Printed columns: (key, title). "other" is computed: the iteration minus the named parts.
PARTS = [
    ("data", "batch"),
    ("forward", "forward"),
    ("backward", "backward"),
    ("p2p", "p2p wait"),
    ("grad-sync", "grad sync"),
    ("grad-norm", "norm+wait"),
    ("clip", "clip"),
    ("adam", "adamw"),
    ("logging", "logging"),
    ("other", "other"),
]
NESTED = {"data": "forward", "grad-norm": "optimizer", "clip": "optimizer", "adam": "optimizer"}
# The OS's per-iteration counters (resource.getrusage): (key, title); SECONDS are printed as ms.
OS_COLUMNS = [
    ("os:main-thread", "train thread"),
    ("os:threads", "other threads"),
    ("os:kernel", "kernel"),
    ("os:faults", "page faults"),
    ("os:waits", "waits"),
    ("os:preempted", "preemptions"),
]
SECONDS = {"os:main-thread", "os:kernel"}


class _Clock:
    """Seconds per part, accumulated within the current iteration; one dict per iteration."""

    def __init__(self):
        self.iterations: list[dict] = []
        self.current: dict = defaultdict(float)
        self.started: tuple[float, float, dict] | None = None  # (wall, process CPU, _usage()) at the start

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start
                self.current[part + ":cpu"] += time.process_time() - cpu

        setattr(owner, name, timed)


def _usage() -> dict:
    """The OS's counters for this process: CPU seconds of the calling (training) thread, kernel CPU
    seconds of the whole process, minor page faults, voluntary and involuntary context switches."""
    own = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    process = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "main-thread": own.ru_utime + own.ru_stime,
        "kernel": process.ru_stime,
        "faults": process.ru_minflt,
        "waits": process.ru_nvcsw,
        "preempted": process.ru_nivcsw,
    }


def _install(clock: _Clock, path: Path) -> None:
    import torch

    from megatron_lite.core.optimizer import optimizer as opt
    from megatron_lite.core.pipeline_parallel import p2p_communication, schedules
    from megatron_lite.training import gpt_step, setup, training

    clock.wrap(gpt_step, "get_batch", "data")
    clock.wrap(schedules, "forward_step", "forward")
    clock.wrap(schedules, "backward_step", "backward")
    clock.wrap(p2p_communication.P2PCommunicator, "_communicate", "p2p")
    clock.wrap(setup, "finalize_model_grads", "grad-sync")  # bound by setup() into the model config
    clock.wrap(opt.MegatronOptimizer, "step", "optimizer")
    clock.wrap(opt, "get_grad_norm_fp32", "grad-norm")
    clock.wrap(opt, "clip_grad_by_total_norm_fp32", "clip")
    clock.wrap(torch.optim.AdamW, "step", "adam")
    clock.wrap(training, "training_log", "logging")
    clock.wrap(training, "memory_metrics", "logging")
    step = training.train_step
    rank = os.environ["RANK"]

    def train_step(*args, **kwargs):
        # An iteration runs from one train_step's start to the next's: its logging follows train_step.
        start, cpu, usage = time.perf_counter(), time.process_time(), _usage()
        if clock.started is not None:
            os_counters = {f"os:{k}": v - clock.started[2][k] for k, v in usage.items()}
            clock.iterations.append(
                {
                    **clock.current,
                    **os_counters,
                    "total": start - clock.started[0],
                    "cpu": cpu - clock.started[1],
                }
            )
            # Written every iteration: workers leave with os._exit.
            path.joinpath(f"rank-{rank}.json").write_text(json.dumps(clock.iterations))
        clock.current, clock.started = defaultdict(float), (start, cpu, usage)
        return step(*args, **kwargs)

    training.train_step = train_step


def _stage_row(iterations: list[dict]) -> dict:
    """Median ms per part over the iterations, 'other' the remainder of each iteration."""
    rows = []
    for it in iterations:
        row = {k: it.get(k, 0.0) * 1000 for k, _ in PARTS if k != "other"}
        row["forward"] -= row["data"]
        named = sum(v for k, v in row.items() if k not in NESTED) + it.get("optimizer", 0.0) * 1000
        row["other"] = it["total"] * 1000 - named
        row["total"] = it["total"] * 1000
        row["cpu"] = it["cpu"] * 1000
        cpu = {f"{k}:cpu": it.get(f"{k}:cpu", 0.0) * 1000 for k, _ in PARTS if k != "other"}
        cpu["forward:cpu"] -= cpu["data:cpu"]
        named = sum(v for k, v in cpu.items() if k[:-4] not in NESTED) + it.get("optimizer:cpu", 0.0) * 1000
        cpu["other:cpu"] = row["cpu"] - named
        os_counters = {k: it[k] * (1000 if k in SECONDS else 1) for k, _ in OS_COLUMNS if k in it}
        if "os:main-thread" in os_counters:
            os_counters["os:threads"] = row["cpu"] - os_counters["os:main-thread"]
        rows.append(row | cpu | os_counters)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> int:
    argv = sys.argv[1:]
    skip = 3
    if argv[:1] == ["--skip"]:
        skip, argv = int(argv[1]), argv[2:]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import pretrain

        _install(_Clock(), Path(os.environ[OUT_ENV]))
        return pretrain.worker_main(argv)
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.launcher import launch

    argv = [*DEFAULT, *argv]
    config = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megatron_lite_breakdown_") as out:
        os.environ[OUT_ENV] = out
        code = launch([sys.executable, os.path.abspath(__file__), *argv], config.world_size)
        if code:
            return code
        stages = {
            int(p.stem.split("-")[1]): json.loads(p.read_text())[skip:] for p in Path(out).glob("rank-*.json")
        }
    print(f"\nper-stage median ms per iteration (iterations {skip + 1}..; {' '.join(argv)})")
    print(f"{'stage':<7}" + "".join(f"{t:>11}" for _, t in PARTS) + f"{'total':>11}{'cpu':>11}")
    rows = {rank: _stage_row(stages[rank]) for rank in sorted(stages)}
    for rank, row in rows.items():
        line = "".join(f"{row[k]:>11.1f}" for k, _ in PARTS)
        print(f"{rank:<7}{line}{row['total']:>11.1f}{row['cpu']:>11.1f}")
    print("the same parts' process CPU time (ms per iteration; p2p and waits are mostly idle)")
    for rank, row in rows.items():
        line = "".join(f"{row[k + ':cpu']:>11.1f}" for k, _ in PARTS)
        print(f"{rank:<7}{line}{'':>11}{row['cpu']:>11.1f}")
    if len(rows) > 1:
        line = "".join(f"{sum(r[k + ':cpu'] for r in rows.values()):>11.1f}" for k, _ in PARTS)
        print(f"{'all':<7}{line}{'':>11}{sum(r['cpu'] for r in rows.values()):>11.1f}")
    if "os:threads" in next(iter(rows.values())):
        print(
            "where the process CPU runs, from the OS (ms per iteration; faults and switches per iteration):"
            " the training thread, the other threads (gloo's transport loops), the kernel on behalf of"
            " the process, minor page faults (fresh pages the kernel zeroes), blocking waits,"
            " preemptions (another runnable process took the core)"
        )
        print(f"{'stage':<7}" + "".join(f"{t:>15}" for _, t in OS_COLUMNS))
        for rank, row in rows.items():
            print(f"{rank:<7}" + "".join(f"{row[k]:>15.1f}" for k, _ in OS_COLUMNS))
    wall, cpu = max(r["total"] for r in rows.values()), sum(r["cpu"] for r in rows.values())
    cores = os.cpu_count() or 1
    print(
        f"process CPU summed over stages: {cpu:.1f} ms per iteration; {cores} cores x {wall:.1f} ms wall:"
        f" {100 * cpu / (cores * wall):.0f}% of the cores' time busy in this job"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
