"""A signal trap (SIGTERM by default) whose verdict all ranks agree on."""

from __future__ import annotations

import signal
import threading
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
