"""A step's metrics and where they go: the one dict (step_metrics), the dashboards (sinks), the
fan-out (writer), the timers' part (timers) and Megatron's console line (console)."""

from megatron_lite.training.metrics.sinks import CometSink, MlflowSink, Sink, TensorBoardSink, WandbSink
from megatron_lite.training.metrics.step_metrics import (
    LOSSES,
    SCALARS,
    TFLOPS,
    TIMERS,
    VALIDATION,
    MetricGroup,
    StepMetrics,
)
from megatron_lite.training.metrics.writer import MetricsWriter

__all__ = [
    "LOSSES",
    "SCALARS",
    "TFLOPS",
    "TIMERS",
    "VALIDATION",
    "CometSink",
    "MetricGroup",
    "MetricsWriter",
    "MlflowSink",
    "Sink",
    "StepMetrics",
    "TensorBoardSink",
    "WandbSink",
]
