"""The test harness itself: run_pretrain's timeout ends the job and every worker it started."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from dist_helpers import SMALL_MODEL, run_pretrain

pytestmark = pytest.mark.world  # every test here starts processes


def _processes_in(directory) -> list[int]:
    """Pids whose working directory is ``directory`` (the job's launcher and workers)."""
    target, found = os.path.realpath(directory), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.path.realpath(f"/proc/{pid}/cwd") == target:
                found.append(int(pid))
        except OSError:  # ended meanwhile, or not ours
            pass
    return found


def test_run_pretrain_timeout_ends_the_job_and_its_workers(tmp_path):
    endless = [*SMALL_MODEL, "--pipeline-model-parallel-size", "2", "--train-iters", "1000000"]
    endless += ["--save", "ck", "--save-interval", "1"]
    with pytest.raises(subprocess.TimeoutExpired):
        run_pretrain(endless, tmp_path, timeout=12)
    assert (tmp_path / "ck").is_dir()  # the workers were training when the timeout struck
    deadline = time.monotonic() + 10
    while _processes_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_in(tmp_path) == []
