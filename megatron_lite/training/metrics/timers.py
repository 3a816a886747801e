"""The timers' part of a step's metrics, and upstream's per-sink timer writers.

training_log takes the timers as a dict (``<name>-time`` -> the slowest rank's seconds) from one
``Timers.write`` into a collector, so one gather serves every sink and the samples are reset once.
Upstream's ``_timers_write_to_wandb`` / ``_mlflow`` / ``_comet`` (which GlobalState.timers binds as
``write_to_<sink>``, upstream's names and signature; our loop does not call them) stay for code that
does: each gathers the timers itself and writes them as that sink writes a step's timers.

All of these are collective over the world (the min/max gather), so every rank calls them, also
where the logger is None (every rank but the last).
"""

from __future__ import annotations

from megatron_lite.core.timers import Timers
from megatron_lite.training.metrics.sinks import CometSink, MlflowSink, Sink, WandbSink
from megatron_lite.training.metrics.step_metrics import TIMERS, StepMetrics


class _Collector:
    """A writer for ``Timers.write`` that keeps what it is given."""

    def __init__(self):
        self.values: dict[str, float] = {}

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.values[name] = value


def timer_metrics(timers: Timers, names: list[str], normalizer: float) -> dict[str, float]:
    """``<name>-time`` -> the slowest rank's time / ``normalizer`` for the timers in ``names`` that ran;
    resets them. Collective over the world."""
    collector = _Collector()
    timers.write(names, collector, 0, normalizer=normalizer, reset=True)  # the collector keeps no step
    return collector.values


def _write_timers(sink: type[Sink], timers, names, logger, iteration, normalizer, reset, barrier) -> None:
    assert normalizer > 0.0, "normalizer must be positive"
    min_max = timers._get_global_min_max_time(names, reset, barrier, normalizer)
    if logger is not None:
        metrics = StepMetrics(iteration)
        metrics.add({name + "-time": high for name, (_, high) in min_max.items()}, kind=TIMERS)
        sink(logger).write(metrics)


def _timers_write_to_wandb(
    self: Timers, names, writer, iteration, normalizer=1.0, reset=True, barrier=False
) -> None:
    """Each timer's max across ranks as ``<name>-time`` to W&B (``writer.log``)."""
    _write_timers(WandbSink, self, names, writer, iteration, normalizer, reset, barrier)


def _timers_write_to_mlflow(
    self: Timers, names, logger, iteration, normalizer=1.0, reset=True, barrier=False
) -> None:
    """Each timer's max across ranks as ``<name>-time`` to MLflow, ``/`` made ``_`` (MLflow keys)."""
    _write_timers(MlflowSink, self, names, logger, iteration, normalizer, reset, barrier)


def _timers_write_to_comet(
    self: Timers, names, logger, iteration, normalizer=1.0, reset=True, barrier=False
) -> None:
    """Each timer's max across ranks as ``<name>-time`` to Comet (names kept as they are)."""
    _write_timers(CometSink, self, names, logger, iteration, normalizer, reset, barrier)
