"""The one fan-out: a step's metrics to every configured sink."""

from __future__ import annotations

from collections.abc import Mapping

from megatron_lite.training.metrics.sinks import CometSink, MlflowSink, Sink, TensorBoardSink, WandbSink
from megatron_lite.training.metrics.step_metrics import StepMetrics


class MetricsWriter:
    """Writes a step's metrics to each configured sink. With no sinks (every rank but the last) it
    does nothing, so callers never check ranks or sinks per metric."""

    def __init__(self, tensorboard=None, wandb=None, mlflow=None, comet=None):
        loggers = (
            (TensorBoardSink, tensorboard),
            (WandbSink, wandb),
            (MlflowSink, mlflow),
            (CometSink, comet),
        )
        self.sinks: list[Sink] = [cls(logger) for cls, logger in loggers if logger is not None]
        """The configured sinks, TensorBoard first (upstream's order)."""

    @classmethod
    def from_state(cls, state) -> MetricsWriter:
        """The sinks of a GlobalState (created lazily there, on the last rank only)."""
        return cls(
            tensorboard=state.tensorboard_logger,
            wandb=state.wandb_logger,
            mlflow=getattr(state, "mlflow_logger", None),
            comet=getattr(state, "comet_logger", None),
        )

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def write_step(self, metrics: StepMetrics) -> None:
        for sink in self.sinks:
            sink.write(metrics)

    def write(self, values: Mapping, step: int) -> None:
        """``values`` as one group at ``step`` (what is logged once, as the predicted memory)."""
        metrics = StepMetrics(step)
        metrics.add(values)
        self.write_step(metrics)
