"""bench/pipeline_vs_torch_pipelining.py on a tiny model: it runs both comparisons on equal work (its
own first-iteration loss check against torch.distributed.pipelining) and reports interleaving's memory
as the schedule predicts; its reduced speed section (no scaling grid) compares whole training steps on
equal work too and names the bf16 matmul kernel. Nothing here asserts a timing."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from dist_helpers import REPO

pytestmark = pytest.mark.world  # every test here starts processes

TINY = "--rounds 1 --skip-scaling --hidden-size 64 --seq-length 32 --vocab-size 128".split()


def test_bench_compares_both_schedules_on_equal_work_with_the_predicted_interleaving_factor():
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "pipeline_vs_torch_pipelining.py"), *TINY],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # One loss line per comparison and one for the training steps: the bench exits non-zero when
    # the schedules' (or ours, the peer's and the single process's) first-iteration losses differ.
    assert out.count("first-iteration loss:") == 3, out
    assert "ScheduleInterleaved1F1B" in out and "Schedule1F1B" in out
    # Stage 0 keeps (pp - 1) * 2 + (vp - 1) * pp + 1 = 11 one-layer chunks in flight against plain
    # 1F1B's pp = 4 microbatches of two layers: measured peaks in Megatron's ratio 1 + 3 / 8.
    measured = re.search(r"interleaved / 1F1B: megatron_lite ([\d.]+),", out)
    assert measured, out
    assert float(measured.group(1)) == pytest.approx(1 + (4 - 1) / (4 * 2), rel=0.1)
    for line in (
        "peer / ours:",
        "single-process / ours:",
        "ideal / ours:",
        "p2p through shared memory:",
        "a bf16 linear runs",
    ):
        assert line in out, out
    assert "-- scaling" not in out  # --skip-scaling
