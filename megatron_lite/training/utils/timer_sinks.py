"""Timer sinks beside Timers.write (TensorBoard): W&B, MLflow and Comet. GlobalState.timers binds each
as ``write_to_<sink>``; they take upstream's signature (the Timers first, as methods do).

Each is collective over the world (the min/max gather), so every rank calls it, also where the
logger is None (every rank but the last).
"""

from __future__ import annotations

import warnings

from megatron_lite.core.timers import Timers


def _max_times(timers: Timers, names, normalizer: float, reset: bool, barrier: bool) -> dict[str, float]:
    """name -> the slowest rank's time / normalizer. Collective over the world."""
    assert normalizer > 0.0, "normalizer must be positive"
    return {
        name: high
        for name, (_, high) in timers._get_global_min_max_time(names, reset, barrier, normalizer).items()
    }


def _log_or_warn(logger, metrics: dict[str, float], iteration: int, sink: str) -> None:
    try:
        logger.log_metrics(metrics, step=iteration)
    except Exception:  # a tracking-server hiccup must not stop training
        warnings.warn(
            f"Failed to log timer metrics to {sink}; continuing without timer metrics.", stacklevel=3
        )


def _timers_write_to_wandb(
    self: Timers,
    names: list[str],
    writer,
    iteration: int,
    normalizer: float = 1.0,
    reset: bool = True,
    barrier: bool = False,
) -> None:
    """Log each timer's max across ranks as ``<name>-time`` to W&B (``writer.log``)."""
    times = _max_times(self, names, normalizer, reset, barrier)
    if writer is not None:
        for name, seconds in times.items():
            writer.log({name + "-time": seconds}, iteration)


def _timers_write_to_mlflow(
    self: Timers,
    names: list[str],
    logger,
    iteration: int,
    normalizer: float = 1.0,
    reset: bool = True,
    barrier: bool = False,
) -> None:
    """Log each timer's max across ranks as ``<name>-time`` to MLflow, ``/`` made ``_`` (MLflow keys)."""
    times = _max_times(self, names, normalizer, reset, barrier)
    if logger is not None:
        _log_or_warn(
            logger, {n.replace("/", "_") + "-time": t for n, t in times.items()}, iteration, "MLFlow"
        )


def _timers_write_to_comet(
    self: Timers,
    names: list[str],
    logger,
    iteration: int,
    normalizer: float = 1.0,
    reset: bool = True,
    barrier: bool = False,
) -> None:
    """Log each timer's max across ranks as ``<name>-time`` to Comet (names kept as they are)."""
    times = _max_times(self, names, normalizer, reset, barrier)
    if logger is not None:
        _log_or_warn(logger, {n + "-time": t for n, t in times.items()}, iteration, "Comet ML")
