"""Linux process hygiene for the processes megatron_lite starts (workers, background writers)."""

from __future__ import annotations

import os
import queue
import signal


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, so none outlives the job."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def name_process(name: str) -> None:
    """Linux: the process's name in ps / top / /proc/<pid>/comm (a fork keeps its parent's command
    line and initial environment, so this is how a forked worker's rank shows)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def jobs_from_parent(jobs, parent: int):
    """A background process's jobs from the queue ``jobs``, until it is sent None or ``parent`` (its
    rank) is gone: a parent killed with SIGKILL says nothing, and its children must not outlive it."""
    while True:
        try:
            job = jobs.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if job is None:
            return
        yield job
