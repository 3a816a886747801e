"""A signal trap (SIGTERM by default) whose verdict all ranks agree on, and the watchdog that ends a
worker promptly on a stop signal in every phase."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_lite.core.utils import get_collective_device


def all_gather_item(
    item: Any, dtype: torch.dtype, group=None, async_op: bool = False, local_rank: int | None = None
) -> list:
    """``item`` from every rank of ``group`` (the world by default), as Python values in rank order;
    ``[item]`` without torch.distributed. Collective over ``group``. ``async_op`` and ``local_rank`` are
    accepted for upstream compatibility: the gather is synchronous and the device follows the backend."""
    if not dist.is_available() or not dist.is_initialized():
        return [item]
    device = get_collective_device(group)
    size = dist.get_world_size(group)
    mine = torch.tensor([item], dtype=dtype, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    return [t.item() for t in gathered]


class DistributedSignalHandler:
    """Records the signal instead of dying, so the loop can finish the iteration, save and exit 0.

    Use as a context manager, or call ``__enter__()`` / ``release()`` directly. The OS trap is only
    installed from the main thread (Python allows no other).
    """

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self._signal_received = False
        """Set by the trap on this rank."""
        self.released = False
        """True once the previous handler is back in place."""
        self.original_handler = None
        self._installed = False

    def signals_received(self) -> list[bool]:
        """Whether each rank got the signal, in rank order. Collective over the world."""
        return [bool(v) for v in all_gather_item(int(self._signal_received), dtype=torch.int32)]

    def _handle(self, signum, frame) -> None:
        self._signal_received = True

    def __enter__(self) -> DistributedSignalHandler:
        self._signal_received = False
        self.released = False
        self._installed = False
        self.original_handler = signal.getsignal(self.sig)
        if threading.current_thread() is threading.main_thread():
            signal.signal(self.sig, self._handle)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {self.sig})  # a mask inherited from the parent
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> bool:
        """Put the previous handler back; False when that already happened."""
        if self.released:
            return False
        if self._installed:
            # None: the previous handler was not installed from Python; the default is the closest.
            previous = signal.SIG_DFL if self.original_handler is None else self.original_handler
            signal.signal(self.sig, previous)
        self.released = True
        return True


STOP_GRACE_S = 10.0


def raise_exit(signum, frame):
    """A stop signal's handler that unwinds (finally-blocks flush and close the loggers) with
    SystemExit(128 + the signal's number)."""
    raise SystemExit(128 + signum)


# How soon a stop signal dropped inside a __del__ is sent again (see _resend_dropped_stops).
RESEND_S = 0.01


def _stop_signal_of(exc: BaseException | None) -> int | None:
    """The stop signal whose handler raised ``exc`` (raise_exit's code, or SIGINT's KeyboardInterrupt)."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code > 128:
        return exc.code - 128
    return None


def _resend_dropped_stops(signals: set[int], previous):
    """A ``sys.unraisablehook``. A stop signal whose handler ran inside a ``__del__`` (a saved-tensor
    release, say) raises where Python cannot propagate: the exception is dropped there, and Python
    prints it with a traceback. Instead, say nothing and send the signal again a moment later, to
    unwind from the code that was running (the watchdog's deadline stands). Other ones go on to
    ``previous``."""

    def hook(unraisable) -> None:
        signum = _stop_signal_of(unraisable.exc_value)
        if signum in signals:
            threading.Timer(RESEND_S, os.kill, (os.getpid(), signum)).start()
            return
        previous(unraisable)

    return hook


def exit_promptly_on(signals: set[int], grace_s: float = STOP_GRACE_S) -> None:
    """After one of ``signals``, this process is gone within ``grace_s`` seconds, whatever it is doing.

    Python runs a signal handler only between bytecodes: a main thread blocked in C++ (connecting to a
    rendezvous store that never answers, a collective waiting on a dead peer) would not see SIGTERM
    until that call returned, minutes later. The interpreter's C handler also writes each signal's
    number to the wakeup pipe set here; a daemon thread waiting on it gives the main thread ``grace_s``
    to unwind through its own handler (closing loggers; a save in progress is atomic, so the previous
    checkpoint stays whole), then ends the process with 128 + the signal's number. Main thread only.

    A signal without a Python handler gets one (KeyboardInterrupt for SIGINT, ``raise_exit`` for the
    others), and each is unblocked: what a process inherits would otherwise make it deaf to them. A
    shell starts a background job with SIGINT ignored, and Python then installs no handler of its own;
    a parent may pass on a mask that blocks them (issue 52: workers that never stopped on SIGINT).
    A handler that runs inside a ``__del__`` cannot unwind from there: the signal is sent again
    (``_resend_dropped_stops``) instead of a traceback being printed.
    """
    for sig in signals:
        if not callable(signal.getsignal(sig)):  # SIG_IGN, SIG_DFL, or set outside Python (None)
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else raise_exit)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    sys.unraisablehook = _resend_dropped_stops(set(signals), sys.unraisablehook)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum in signals:
                    time.sleep(grace_s)
                    os._exit(128 + signum)

    threading.Thread(target=watch, name="stop-signal-watchdog", daemon=True).start()
