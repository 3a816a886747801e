#!/usr/bin/env python
"""What each activation lever saves, stage by stage, measured on the per-stage dashboards.

    python bench/activation_levers.py [--iters 3]

Runs `pretrain.py` (pp = 4, 8 layers, 16 microbatches' global batch, CPU) with no lever, full/uniform
recompute (N = 1), full/block (N = 1) and selective recompute; at tp = 2, pp = 4 (8 ranks) with and
without --sequence-parallel; and with two layers moved from the first stage to the last
(--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3). Each stage's peak activation bytes (saved for backward, measured by the
tracker) are read back from the TensorBoard events `memory/pp-stage-<i>/mem-max-activation-gigabytes`,
with the ratio to the run without the lever, and the elapsed time per iteration.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODEL = (
    "--pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --vocab-size 256 --micro-batch-size 2 --global-batch-size 32 "
    "--log-interval 1 --log-memory-to-tensorboard --log-memory-per-pp-stage"
).split()
RECOMPUTE = {
    "no recompute": [],
    "full/uniform N=1": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split(),
    "full/block N=1": "--recompute-granularity full --recompute-method block --recompute-num-layers 1".split(),
    "selective (core_attn)": ["--recompute-activations"],
}
SEQUENCE_PARALLEL = {"tp=2": ["--tensor-model-parallel-size", "2"]}
SEQUENCE_PARALLEL["tp=2 + sequence parallel"] = [*SEQUENCE_PARALLEL["tp=2"], "--sequence-parallel"]
SPLIT = {
    "even, 2-2-2-2 layers": [],
    "uneven, 1-2-2-3 layers": "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3".split(),
}
ELAPSED = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def run(flags: list[str], iters: int) -> tuple[list[float], float]:
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [sys.executable, os.path.join(REPO, "pretrain.py"), *MODEL, *flags, "--train-iters", str(iters),
             "--tensorboard-dir", "tb"],
            cwd=tmp, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if result.returncode != 0:
            raise SystemExit(f"pretrain.py failed: {result.stderr.strip().splitlines()[-1]}")
        acc = EventAccumulator(os.path.join(tmp, "tb"), size_guidance={"scalars": 0})
        acc.Reload()
        tag = "memory/pp-stage-{}/mem-max-activation-gigabytes"
        peaks = [max(e.value for e in acc.Scalars(tag.format(s))) * 1024**3 for s in range(4)]
        times = [float(ms) for it, ms in ELAPSED.findall(result.stdout) if int(it) > 1]
        return peaks, statistics.median(times)


def table(title: str, levers: dict[str, list[str]], iters: int) -> None:
    print(f"\n{title}: peak activation bytes per rank of each stage (ratio to the first row)")
    print(f"{'lever':<26}" + "".join(f"{'stage ' + str(s):>20}" for s in range(4)) + f"{'ms/iter':>10}")
    baseline = None
    for name, flags in levers.items():
        peaks, ms = run(flags, iters)
        baseline = baseline or peaks
        cells = "".join(f"{p / 2**20:>10.2f} MiB {p / b:>5.2f}x" for p, b in zip(peaks, baseline))
        print(f"{name:<26}{cells}{ms:>10.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    table("Recomputation, pp=4", RECOMPUTE, args.iters)
    table("Sequence parallelism, tp=2 pp=4", SEQUENCE_PARALLEL, args.iters)
    table("Layer split, pp=4", SPLIT, args.iters)


if __name__ == "__main__":
    main()
