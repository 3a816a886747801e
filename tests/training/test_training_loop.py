"""The loop's user-visible output: Megatron's iteration line, validation, and the metrics written."""

from __future__ import annotations

import re

import pytest
from dist_helpers import SMALL_MODEL, run_pretrain
from event_files import scalars

pytestmark = pytest.mark.world  # every test here starts processes

ITERATION_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +6 \| consumed samples: +(\d+) \| "
    r"elapsed time per iteration \(ms\): [\d.]+ \| throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| "
    r"learning rate: \d\.\d{6}E[+-]\d\d \| global batch size: +8 \| lm loss: \d\.\d{6}E[+-]\d\d \| "
    r"loss scale: 1\.0 \| grad norm: [\d.]+ \| params norm: [\d.]+ \| number of skipped iterations: +0 \| "
    r"number of nan iterations: +0 \|$"
)


def test_iteration_lines_validation_and_metrics(tmp_path):
    result = run_pretrain(
        [
            *SMALL_MODEL,
            "--pipeline-model-parallel-size",
            "2",
            "--nproc-per-node",
            "4",
            "--train-iters",
            "6",
            "--log-interval",
            "2",
            "--eval-interval",
            "3",
            "--eval-iters",
            "2",
            "--log-params-norm",
            "--log-throughput",
            "--log-throughput-to-tensorboard",
            "--throughput-window-size",
            "2",
            "--log-timers-to-tensorboard",
            "--timing-log-level",
            "1",
            "--tensorboard-dir",
            "tb",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = [ln for ln in result.stdout.splitlines() if "] iteration " in ln]
    matches = [ITERATION_LINE.match(ln) for ln in lines]
    assert all(matches), lines
    assert [(int(m.group(1)), int(m.group(2))) for m in matches] == [(2, 16), (4, 32), (6, 48)]
    assert not any(ln.startswith("[rank") for ln in lines)  # the last rank's lines come through plain
    validation = [ln for ln in result.stdout.splitlines() if "validation loss at iteration" in ln]
    assert [int(re.search(r"iteration (\d+)", ln).group(1)) for ln in validation] == [3, 6]
    assert all("lm loss PPL:" in ln for ln in validation)
    memory_lines = [ln for ln in result.stdout.splitlines() if "(after 2 iterations) memory (GB)" in ln]
    assert len(memory_lines) == 2  # data-parallel rank 0 of each of the two stages

    logged = scalars(tmp_path / "tb")
    for tag in (
        "lm loss",
        "learning-rate",
        "batch-size",
        "grad-norm",
        "params-norm",
        "loss-scale",
        "forward-backward-time",
        "optimizer-time",
    ):
        assert sorted(logged[tag]) == list(range(1, 7)), tag
        if tag != "forward-backward-time" and tag != "optimizer-time":
            assert sorted(logged[f"{tag} vs samples"]) == [8 * i for i in range(1, 7)], tag
    # The windowed rates need two iterations' end times; TFLOP/s and iteration time are per interval.
    assert sorted(logged["throughput/tokens_per_sec"]) == list(range(2, 7))
    assert sorted(logged["throughput/tflops/device"]) == sorted(logged["iteration-time"]) == [2, 4, 6]
    assert logged["throughput/tflops/device"][2] > 0
    assert sorted(logged["lm loss validation"]) == [3, 6]
    assert logged["batch-size"][1] == 8
    assert logged["learning-rate"][1] > logged["learning-rate"][6]
