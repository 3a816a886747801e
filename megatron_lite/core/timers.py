"""Named wall-clock timers with megatron.core.timers' interface.

``timers("forward-backward", log_level=1).start()`` ... ``.stop()``; ``timers.log(names)`` prints the
min/max (or every rank's) time, ``timers.write(names, writer, iteration)`` sends the max across ranks
to a TensorBoard writer (or anything with ``log(dict, step)``, such as the ``wandb`` module). A timer
above the Timers' ``log_level`` is a DummyTimer: starting and stopping it costs nothing.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_lite.core.process_group_utils import get_collective_device

LOG_OPTIONS = ("max", "minmax", "all")
"""``max``: the slowest rank per timer; ``minmax``: fastest and slowest; ``all``: every rank's time."""
MAX_LOG_LEVEL = 2
"""Timers created without a level get this one, so they only run at the most verbose setting."""


def _sync_device() -> None:
    # Kernels run asynchronously: wait for them so the interval covers the work, not just its launch.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class DummyTimer:
    """Stands in for a timer above the log level; reading it is a mistake, so that raises."""

    name = "dummy timer"

    def start(self, barrier: bool = False) -> None:
        return

    def stop(self, barrier: bool = False) -> None:
        return

    def reset(self) -> None:
        return

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        raise Exception(f"{self.name} has no elapsed time: its log level is above the Timers' log_level")

    def active_time(self) -> float:
        raise Exception(f"{self.name} has no active time: its log level is above the Timers' log_level")


class Timer:
    """Accumulates seconds between start() and stop(). ``barrier=True`` makes the call a barrier over
    the timer's barrier group (the world by default): every rank of it must make the same call."""

    def __init__(self, name: str):
        self.name = name
        self._elapsed = 0.0
        self._active_time = 0.0
        """Seconds ever spent running; reset() leaves it alone."""
        self._started = False
        self._barrier_group = None
        self._start_time = time.time()

    def set_barrier_group(self, barrier_group) -> None:
        self._barrier_group = barrier_group

    def start(self, barrier: bool = False) -> None:
        if self._started:
            raise AssertionError(f"timer {self.name} has already been started")
        if barrier:
            dist.barrier(group=self._barrier_group)
        _sync_device()
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        if not self._started:
            raise AssertionError(f"timer {self.name} is not started")
        if barrier:
            dist.barrier(group=self._barrier_group)
        _sync_device()
        spent = time.time() - self._start_time
        self._elapsed += spent
        self._active_time += spent
        self._started = False

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started = False

    def set_elapsed(self, value: float) -> None:
        """Record a time measured elsewhere (e.g. start-up), so log() reports it like any other."""
        self._elapsed = value

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated since the last reset, including a running segment (which goes on)."""
        running = self._started
        if running:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        return self._active_time


class Timers:
    """A group of named timers; ``log_level`` (0-2) decides which are real, ``log_option`` (one of
    LOG_OPTIONS) what log() reports across ranks."""

    def __init__(self, log_level: int, log_option: str):
        if log_option not in LOG_OPTIONS:
            raise AssertionError(f"timing log option {log_option!r} is invalid; use one of {LOG_OPTIONS}")
        self._log_level = log_level
        self._log_option = log_option
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy_timer = DummyTimer()
        self._max_log_level = MAX_LOG_LEVEL

    def __call__(self, name: str, log_level: int | None = None) -> Timer | DummyTimer:
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise AssertionError(
                    f"timer {name} exists with log level {self._log_levels[name]}, not {log_level}"
                )
            return self._timers[name]
        level = self._max_log_level if log_level is None else log_level
        if level > self._max_log_level:
            raise AssertionError(f"log level {level} is above the maximum {self._max_log_level}")
        if level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = level
        return self._timers[name]

    def elapsed_times(self, names: list[str] | None = None, reset: bool = True) -> dict[str, float]:
        """This rank's seconds per existing timer in ``names`` (all when None). Local: no collective."""
        chosen = self._timers if names is None else {n: self._timers[n] for n in names if n in self._timers}
        return {name: t.elapsed(reset) for name, t in chosen.items()}

    def _get_elapsed_time_all_ranks(self, names: list[str], reset: bool, barrier: bool):
        """A [world_size, len(names)] tensor of every rank's seconds (0 where a rank lacks the timer),
        or None for no names. Collective over the world: every rank calls it with the same names."""
        if len(names) == 0:
            return None
        if barrier and dist.is_initialized():
            dist.barrier()
        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = torch.zeros(len(names), dtype=torch.float, device=get_collective_device())
        for i, name in enumerate(names):
            if name in self._timers:
                mine[i] = self._timers[name].elapsed(reset=reset)
        if world == 1:
            return mine.unsqueeze(0)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        return torch.stack(rows)

    def _get_global_min_max_time(self, names, reset, barrier, normalizer) -> dict[str, tuple[float, float]]:
        """name -> (min, max) over the ranks that ran the timer, divided by ``normalizer``. Collective
        over the world."""
        names = list(names)
        times = self._get_elapsed_time_all_ranks(names, reset, barrier)
        per_name = times.t().tolist() if times is not None else []
        result = {}
        for name, per_rank in zip(names, per_name):
            ran = [t for t in per_rank if t > 0.0]
            if ran:
                result[name] = (min(ran) / normalizer, max(ran) / normalizer)
        return result

    def _get_global_min_max_time_string(self, names, reset, barrier, normalizer, max_only):
        min_max = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if not min_max:
            return None
        lines = ["max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"]
        for name, (low, high) in min_max.items():
            values = f"{high:.2f}" if max_only else f"({low:.2f}, {high:.2f})"
            lines.append(f"    {(name + ' ').ljust(48, '.')}: {values}")
        return "\n".join(lines)

    def _get_all_ranks_time_string(self, names, reset, barrier, normalizer):
        names = list(names)
        times = self._get_elapsed_time_all_ranks(names, reset, barrier)
        if times is None:
            return None
        lines = ["times across ranks (ms):"]
        for i, name in enumerate(names):
            ranks = [(r, t) for r, t in enumerate(times[:, i].tolist()) if t > 0]
            if ranks:
                lines.append(f"  {name}:")
                lines.extend(f"     rank {r:2d}: {t / normalizer:.2f}" for r, t in ranks)
        return "\n".join(lines) if len(lines) > 1 else None

    def get_all_timers_string(
        self,
        names: list[str] | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> str | None:
        """The report log() prints, in milliseconds (None when no timer ran). Collective over the world."""
        if names is None:
            names = list(self._timers)
        if not normalizer > 0.0:
            raise AssertionError(f"normalizer must be positive, got {normalizer}")
        ms_normalizer = normalizer / 1000.0
        if self._log_option == "all":
            return self._get_all_ranks_time_string(names, reset, barrier, ms_normalizer)
        return self._get_global_min_max_time_string(
            names, reset, barrier, ms_normalizer, max_only=self._log_option == "max"
        )

    def log(
        self,
        names: list[str],
        rank: int | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Print the timers' report on ``rank`` (the last rank by default). Collective over the world."""
        report = self.get_all_timers_string(names, normalizer, reset, barrier)
        world = dist.get_world_size() if dist.is_initialized() else 1
        here = dist.get_rank() if dist.is_initialized() else 0
        if report is not None and here == (world - 1 if rank is None else rank):
            print(report, flush=True)

    def write(
        self,
        names: list[str],
        writer,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Write each timer's max across ranks as ``<name>-time`` to a TensorBoard writer (add_scalar)
        or a W&B-style one (log). Collective over the world, also on ranks whose writer is None."""
        if not normalizer > 0.0:
            raise AssertionError(f"normalizer must be positive, got {normalizer}")
        min_max = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if writer is None:
            return
        for name, (_, high) in min_max.items():
            if hasattr(writer, "add_scalar"):
                writer.add_scalar(name + "-time", high, iteration)
            else:
                writer.log({name + "-time": high}, iteration)
