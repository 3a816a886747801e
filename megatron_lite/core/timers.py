"""Named wall-clock timers, as megatron.core.timers (without cross-rank gathering)."""

from __future__ import annotations

import time

import torch


class Timer:
    def __init__(self, name: str):
        self.name = name
        self._elapsed = 0.0
        self._start: float | None = None

    def start(self, barrier: bool = False) -> None:
        if barrier and torch.distributed.is_initialized():
            torch.distributed.barrier()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if self._start is None:
            raise RuntimeError(f"timer {self.name} stopped before it started")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self._elapsed += time.perf_counter() - self._start
        self._start = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated since the last reset, including a running segment (which goes on)."""
        running = self._start is not None
        if running:
            self.stop()
        value = self._elapsed
        if reset:
            self._elapsed = 0.0
        if running:
            self.start()
        return value


class Timers:
    """``timers("forward-backward", log_level=1).start()``; timers above ``log_level`` are no-ops."""

    def __init__(self, log_level: int = 1):
        self.log_level = log_level
        self._timers: dict[str, Timer] = {}
        self._dummy = Timer("dummy")

    def __call__(self, name: str, log_level: int = 0) -> Timer:
        if log_level > self.log_level:
            return self._dummy
        if name not in self._timers:
            self._timers[name] = Timer(name)
        return self._timers[name]

    def elapsed_times(self, names: list[str] | None = None, reset: bool = True) -> dict[str, float]:
        """Seconds accumulated by each named timer (all timers when ``names`` is None)."""
        chosen = self._timers if names is None else {n: self._timers[n] for n in names if n in self._timers}
        return {name: t.elapsed(reset) for name, t in chosen.items()}
