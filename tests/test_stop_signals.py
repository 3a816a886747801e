"""A stop signal ends a worker promptly in every phase, even blocked in C++ where no Python handler
runs: here, set-up, connecting to a rendezvous store that accepts the connection and never answers
(torchrun's environment, this test's socket as the store). Training and the launcher's forwarding
are covered by test_launcher's SIGTERM / Ctrl-C tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from dist_helpers import PRETRAIN, SMALL_MODEL

from megatron_lite.training.utils.sig_utils import STOP_GRACE_S

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _worker_at(port: int, cwd) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen(
        [sys.executable, PRETRAIN, *SMALL_MODEL, "--train-iters", "2"],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_worker_stuck_at_rendezvous_exits_on_sigterm_and_on_sigint(tmp_path):
    stores = [socket.create_server(("127.0.0.1", 0)) for _ in SIGNALS]  # they listen, never answer
    workers = [_worker_at(store.getsockname()[1], tmp_path) for store in stores]  # one per signal
    try:
        connections = []
        for store in stores:
            store.settimeout(120)
            connections.append(store.accept()[0])  # that worker is in rendezvous now, blocked in C++
        time.sleep(0.5)
        assert all(worker.poll() is None for worker in workers)
        sent = time.monotonic()
        for worker, sig in zip(workers, SIGNALS):
            worker.send_signal(sig)
        codes = [worker.wait(timeout=STOP_GRACE_S + 15) for worker in workers]
        took = time.monotonic() - sent
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
        for sock in (*stores, *connections):
            sock.close()
    assert codes == [128 + sig for sig in SIGNALS], [w.stderr.read() for w in workers]
    # The store's own timeout is --distributed-timeout-minutes (10): the watchdog ended them.
    assert took < STOP_GRACE_S + 10
