#!/usr/bin/env python
"""A MoE job's memory per pipeline stage and per expert-parallel rank, beside the prediction, and its
token imbalance over iterations.

    python bench/moe_memory.py

Runs pretrain.py (pp 2 x ep 2, 4 ranks, CPU gloo, 4 iterations, 4 experts top-2, all-to-all, grouped
GEMM) with --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity and without a capacity
factor, logging memory per stage. Prints, from the run's TensorBoard events (MB = 1e6 bytes): each
stage's peak saved activations and allocated peak for each EP rank (``ep-rank-<r>/...``, the MAX over
EP ranks being the stage's dashboard value), the predicted activations (exact with padding; balanced
and the worst-routing bound without), and ``moe/tokens_imbalance`` (max / mean tokens per expert over
the global batch) per iteration. No timing is asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
JOB = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--vocab-size 256 --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --train-iters 4 --log-interval 1 "
    "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --expert-model-parallel-size 2 "
    "--pipeline-model-parallel-size 2 --nproc-per-node 4 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
    "--log-memory-to-tensorboard --log-memory-per-pp-stage"
).split()
CASES = {
    "capacity 1.0, padded": ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
    "no capacity factor": [],
}


def run(extra: list[str]) -> EventAccumulator:
    tb = tempfile.mkdtemp(prefix="moe_memory_")
    cmd = [sys.executable, os.path.join(REPO, "pretrain.py"), *JOB, *extra, "--tensorboard-dir", tb]
    subprocess.run(cmd, cwd=tb, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    acc = EventAccumulator(tb, size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def main() -> None:
    for name, extra in CASES.items():
        acc = run(extra)
        tags = set(acc.Tags()["scalars"])

        def last(tag, acc=acc, tags=tags):
            return acc.Scalars(tag)[-1].value * 1e3 if tag in tags else float("nan")  # GB -> MB

        print(f"\n== {name} ==")
        print(f"{'stage':>5} {'ep':>3} {'act MB':>8} {'peak MB':>8} {'pred act':>9} {'worst':>8}")
        for stage in range(2):
            p = f"memory/pp-stage-{stage}/"
            for ep in range(2):
                act = last(f"{p}ep-rank-{ep}/mem-max-activation-gigabytes")
                peak = last(f"{p}ep-rank-{ep}/mem-max-allocated-gigabytes")
                pred = last(f"{p}predicted-max-activation-gigabytes")
                worst = last(f"{p}predicted-max-activation-worst-gigabytes")
                print(f"{stage:>5} {ep:>3} {act:>8.3f} {peak:>8.3f} {pred:>9.3f} {worst:>8.3f}")
        imbalance = (
            [f"{e.value:.3f}" for e in acc.Scalars("moe/tokens_imbalance")]
            if "moe/tokens_imbalance" in tags
            else []
        )
        print(f" moe/tokens_imbalance per iteration: {' '.join(imbalance)}")


if __name__ == "__main__":
    main()
