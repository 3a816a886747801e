#!/usr/bin/env python
"""What the distributed optimizer saves and what the overlap flags cost or gain (CPU, gloo).

    python bench/distributed_optimizer.py [--iters 12] [--hidden-size 256]

For dp = 2 and dp = 4 and the four combinations of --use-distributed-optimizer and overlap
(--overlap-grad-reduce, plus --overlap-param-gather with the distributed optimizer), runs pretrain.py
and prints the optimizer-state bytes per rank (the measured ``memory/mem-optimizer-state-gigabytes``
that the run logs to TensorBoard) and the median elapsed time per iteration (first two skipped).
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
ELAPSED = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def run(dp: int, sharded: bool, overlap: bool, args) -> tuple[float, float]:
    flags = ["--use-distributed-optimizer"] if sharded else []
    if overlap:
        flags += ["--overlap-grad-reduce", "--ddp-bucket-size", str(args.bucket_size)]
        flags += ["--overlap-param-gather"] if sharded else []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            os.path.join(REPO, "pretrain.py"),
            *f"--num-layers 4 --hidden-size {args.hidden_size} --num-attention-heads 4 --seq-length 128 "
            f"--max-position-embeddings 128 --vocab-size 1024 --micro-batch-size 2 "
            f"--global-batch-size {4 * dp} --train-iters {args.iters} --log-interval 1 "
            f"--nproc-per-node {dp} --log-memory-to-tensorboard --tensorboard-dir {tmp}/tb".split(),
            *flags,
        ]
        out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=True).stdout
        acc = EventAccumulator(f"{tmp}/tb", size_guidance={"scalars": 0})
        acc.Reload()
        state_gb = acc.Scalars("memory/mem-optimizer-state-gigabytes")[-1].value
    times = [float(ms) for it, ms in ELAPSED.findall(out) if int(it) > 2]
    return state_gb * 1e9, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--bucket-size", type=int, default=200_000)
    args = parser.parse_args()
    print(
        f"{'dp':>3} {'distributed optimizer':>22} {'overlap':>8} {'optimizer state / rank':>24} {'ms/iter':>8}"
    )
    for dp in (2, 4):
        for sharded in (False, True):
            for overlap in (False, True):
                state_bytes, ms = run(dp, sharded, overlap, args)
                print(f"{dp:>3} {sharded!s:>22} {overlap!s:>8} {state_bytes / 1e6:>21.3f} MB {ms:>8.1f}")


if __name__ == "__main__":
    main()
