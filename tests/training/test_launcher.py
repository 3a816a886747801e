"""pretrain.py starts its own workers, streams them, and takes the whole job down when one dies."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import termios
import time

import pytest
from dist_helpers import PRETRAIN, SMALL_MODEL
from job_helpers import Job, alive, children

pytestmark = pytest.mark.world  # every test here starts processes

LONG_RUN = ["--pipeline-model-parallel-size", "4", "--train-iters", "100000", *SMALL_MODEL]


def test_killing_one_worker_stops_the_job_fast(tmp_path):
    job = Job(LONG_RUN, tmp_path)
    job.wait_for("iteration        2/")
    workers = children(job.proc.pid)
    assert len(workers) == 4
    os.kill(workers[1], signal.SIGKILL)
    start = time.monotonic()
    code = job.proc.wait(timeout=60)
    elapsed = time.monotonic() - start
    assert code != 0
    assert elapsed < 30, elapsed
    assert not any(alive(pid) for pid in workers)
    time.sleep(0.5)
    message = "".join(job.err)
    assert message.count("was killed by SIGKILL") == 1, message


def _unread_pipe(capacity: int = 4096) -> tuple[int, int]:
    """A pipe nobody reads, as small as Linux allows, so it fills within a few iterations."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, capacity)
    return read_end, write_end


def _queued_bytes(read_end: int) -> int:
    return int.from_bytes(fcntl.ioctl(read_end, termios.FIONREAD, b"\0" * 4), "little")


def test_a_stalled_output_reader_does_not_keep_a_failed_job_up(tmp_path):
    out_read, out_write = _unread_pipe()
    err_read, err_write = _unread_pipe()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(
        [sys.executable, PRETRAIN, *LONG_RUN], cwd=tmp_path, env=env, stdout=out_write, stderr=err_write
    )
    os.close(out_write)
    os.close(err_write)
    try:
        deadline = time.monotonic() + 120
        while _queued_bytes(out_read) < 4096 - 512:  # the launcher's stdout is (nearly) full
            assert proc.poll() is None and time.monotonic() < deadline, "the job's stdout never filled"
            time.sleep(0.1)
        time.sleep(1.0)  # the launcher is now blocked writing to it
        workers = children(proc.pid)
        assert len(workers) == 4
        os.kill(workers[1], signal.SIGKILL)
        code = proc.wait(timeout=60)
        assert code != 0
        assert not any(alive(pid) for pid in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(out_read)
        os.close(err_read)


def test_sigterm_stops_every_worker_and_flushes_logs(tmp_path):
    job = Job([*LONG_RUN, "--tensorboard-dir", str(tmp_path / "tb"), "--log-memory-to-tensorboard"], tmp_path)
    job.wait_for("iteration        2/")
    workers = children(job.proc.pid)
    job.proc.send_signal(signal.SIGTERM)
    code = job.proc.wait(timeout=60)
    assert code == 128 + signal.SIGTERM
    assert not any(alive(pid) for pid in workers)
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_ctrl_c_stops_every_worker(tmp_path):
    job = Job(LONG_RUN, tmp_path)
    job.wait_for("iteration        1/")
    workers = children(job.proc.pid)
    job.proc.send_signal(signal.SIGINT)
    code = job.proc.wait(timeout=60)
    assert code == 128 + signal.SIGINT
    assert not any(alive(pid) for pid in workers)


def test_under_torchrun_the_environment_is_used_unchanged(tmp_path):
    from dist_helpers import free_port, parse_losses

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            PRETRAIN,
            *SMALL_MODEL,
            "--pipeline-model-parallel-size",
            "2",
            "--train-iters",
            "3",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(parse_losses(result.stdout)) == [1, 2, 3]
    assert "world 2 = tp 1 x pp 2" in result.stdout
