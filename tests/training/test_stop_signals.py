"""A stop signal ends a worker promptly in every phase, even blocked in C++ where no Python handler
runs: here, set-up, connecting to a rendezvous store that accepts the connection and never answers
(torchrun's environment, this test's socket as the store). Also whatever the worker inherits: a
shell starts a background job with SIGINT ignored (and Python then installs no handler of its own),
and a parent may pass on a mask that blocks the stop signals (issue 52). Training and the launcher's
forwarding are covered by test_launcher's SIGTERM / Ctrl-C tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from dist_helpers import PRETRAIN, SMALL_MODEL, free_port

from megatron_lite.training.utils.sig_utils import STOP_GRACE_S

pytestmark = pytest.mark.world  # every test here starts processes

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Runs a command as a non-interactive shell runs `command &` (SIGINT and SIGQUIT ignored), with the
# stop signals blocked besides: the worst a worker can inherit.
_AS_BACKGROUND_JOB = (
    "import os, signal, sys; "
    "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT)]; "
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)
INHERITED = {"as started": [], "as a background job, stop signals blocked": ["-c", _AS_BACKGROUND_JOB]}


def _python(inherited: str) -> list[str]:
    return [sys.executable, *INHERITED[inherited]]


def _env(port: int, rank: int, world: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    return env


def _worker_at(port: int, cwd, inherited: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*_python(inherited), PRETRAIN, *SMALL_MODEL, "--train-iters", "2"],
        cwd=cwd,
        env=_env(port, 1, 2),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_worker_stuck_at_rendezvous_exits_on_sigterm_and_on_sigint(tmp_path):
    """Each stop signal, as started and as a background job with the stop signals blocked: one worker
    per case, all stuck at once, so the watchdog's grace is waited for once."""
    cases = [(inherited, sig) for inherited in INHERITED for sig in SIGNALS]
    stores = [socket.create_server(("127.0.0.1", 0)) for _ in cases]  # they listen, never answer
    workers = [
        _worker_at(store.getsockname()[1], tmp_path, inherited)
        for store, (inherited, _) in zip(stores, cases)
    ]
    connections = []
    try:
        for store in stores:
            store.settimeout(120)
            connections.append(store.accept()[0])  # that worker is in rendezvous now, blocked in C++
        time.sleep(0.5)
        assert all(worker.poll() is None for worker in workers)
        sent = time.monotonic()
        for worker, (_, sig) in zip(workers, cases):
            worker.send_signal(sig)
        codes = [worker.wait(timeout=STOP_GRACE_S + 15) for worker in workers]
        took = time.monotonic() - sent
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
        for sock in (*stores, *connections):
            sock.close()
    named = {f"{inherited}, {sig.name}": code for (inherited, sig), code in zip(cases, codes)}
    assert named == {f"{inherited}, {sig.name}": 128 + sig for inherited, sig in cases}, [
        w.stderr.read() for w in workers
    ]
    # The store's own timeout is --distributed-timeout-minutes (10): the watchdog ended them.
    assert took < STOP_GRACE_S + 10


# A worker's whole life (a real async save, then exit_promptly_on's set-up on the way out is long
# done), then a child started from it: what that child inherits. Printed as JSON on the last line.
_TRAIN_THEN_START_A_CHILD = """
import json, os, runpy, subprocess, sys
pretrain = runpy.run_path(sys.argv[1])
code = pretrain["worker_main"](sys.argv[2:])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(f"/proc/{child.pid}/status") as f:
    sets = {k: int(v, 16) for k, v in (line.split(":", 1) for line in f) if k in ("SigBlk", "SigIgn")}
child.kill()
child.wait()
print(json.dumps({"code": code, **sets}), flush=True)
os._exit(0)
"""


def test_a_child_started_after_an_async_save_can_be_stopped(tmp_path):
    """The library blocks the stop signals around starting its background checkpoint writer, and the
    worker was itself started as a background job with them blocked: neither may reach a process the
    worker starts later."""
    args = [
        *SMALL_MODEL, "--train-iters", "2", "--save", "ckpt", "--save-interval", "1", "--async-save",
        "--ckpt-format", "torch_dist",
    ]  # fmt: skip
    done = subprocess.run(
        [*_python("as a background job, stop signals blocked"), "-c", _TRAIN_THEN_START_A_CHILD, PRETRAIN,
         *args],
        cwd=tmp_path, env=_env(free_port(), 0, 1), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, done.stdout[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for sig in SIGNALS:
        bit = 1 << (sig - 1)
        assert not report["SigBlk"] & bit, f"{signal.Signals(sig).name} blocked in a child"
        assert not report["SigIgn"] & bit, f"{signal.Signals(sig).name} ignored in a child"


_STOPPED_IN_DEL = """
import os, signal, sys, time
from megatron_lite.training.utils.sig_utils import exit_promptly_on

exit_promptly_on({signal.SIGTERM}, grace_s=30.0)


class Releases:
    def __del__(self):  # a saved-tensor release, say: the signal lands in here
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            pass


try:
    Releases()
    while True:
        time.sleep(0.01)
finally:
    print("unwound", flush=True)
"""


@pytest.mark.world
def test_a_stop_signal_inside_a_del_unwinds_without_a_traceback(tmp_path):
    """Python cannot raise a handler's exception out of a ``__del__``: it would drop it and print a
    traceback. The signal is sent again instead, and the process unwinds from its main code (its
    finally-blocks run) with 128 + SIGTERM, well before the watchdog's 30 s."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _STOPPED_IN_DEL], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert result.stdout == "unwound\n" and result.stderr == "", result.stderr
    assert time.monotonic() - start < 20
