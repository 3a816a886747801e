"""SIGTERM handling that all ranks agree on."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from megatron_lite.core.utils import get_collective_device


class DistributedSignalHandler:
    """Records SIGTERM instead of dying, so the loop can finish the iteration, save and exit 0."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self.received = False
        self._previous = None

    def __enter__(self) -> DistributedSignalHandler:
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(self.sig, self._previous)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def signals_received(self) -> bool:
        """True if any rank got the signal. Collective over the world (one MAX all-reduce)."""
        flag = torch.tensor([int(self.received)], dtype=torch.int32, device=get_collective_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
