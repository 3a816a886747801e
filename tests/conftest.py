"""Every test leaves the pytest process as it found it.

Tests share one process, and every child a later test starts (``subprocess``, the forkserver, a forked
rank) inherits that process's signal mask and ignored signals. A test that leaves SIGTERM blocked or
SIGINT ignored makes a worker started by another test, much later, deaf to a stop signal (issue 52).
So each test is checked, after its own fixtures are undone, for what it changed of the state a child
inherits or the next test reads: signal handlers, the blocked and ignored signal sets, the wakeup fd,
the environment, the working directory and the multiprocessing start method.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

# The world mark and its check: the fast lane (make test-fast) runs only tests that start no process.
pytest_plugins = ["lanes", "pytester"]

# Imported before any test: importing them sets process state of their own (MLflow's telemetry
# session id in the environment), which is theirs, not a test's.
for _sink in ("wandb", "mlflow", "comet_ml"):
    try:
        __import__(_sink)
    except ImportError:  # optional sinks
        pass

# Set by pytest, or by a library for itself on its first use (torch's compiler, on the first fake-tensor
# trace): not a test's doing.
_NOT_A_TESTS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}
_SIGNALS = sorted(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}, key=int)


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:  # a real-time signal
        return f"signal {int(sig)}"


def _kernel_signal_sets() -> dict[str, str]:
    """The main thread's blocked and ignored sets as the kernel has them (what a child inherits),
    which also shows a change made from C, outside Python's handler table."""
    with open("/proc/thread-self/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f) if k in ("SigBlk", "SigIgn")}


def _wakeup_fd() -> int:
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


def process_state() -> dict[str, object]:
    """What a test must leave as it found it. Main thread only (signal calls need it)."""
    return {
        "signal handlers": {_name(s): signal.getsignal(s) for s in _SIGNALS},
        "signal sets": _kernel_signal_sets(),
        "wakeup fd": _wakeup_fd(),
        "environment": {k: v for k, v in os.environ.items() if k not in _NOT_A_TESTS},
        "working directory": os.getcwd(),
        # Unset means the platform's default, which a first get_start_method() merely fixes.
        "multiprocessing start method": multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_all_start_methods()[0],
    }


def changed(before: dict, after: dict) -> list[str]:
    """One line per part of the state that differs, naming what changed."""
    lines = []
    for part, was in before.items():
        now = after[part]
        if was == now:
            continue
        if isinstance(was, dict):
            keys = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
            lines.append(f"{part}: " + ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in keys))
        else:
            lines.append(f"{part}: {was!r} -> {now!r}")
    return lines


@pytest.fixture
def restored_environment():
    """For a test that runs code which sets environment variables in this process on purpose (a
    logger's defaults, a tool's worker set-up): the environment is put back as it was afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _process_state_restored():
    # Autouse: set up before, and so torn down after, the test's own fixtures (monkeypatch included).
    before = process_state()
    yield
    leaked = changed(before, process_state())
    if leaked:
        pytest.fail("the test left process-wide state changed:\n  " + "\n  ".join(leaked), pytrace=False)
