"""The dashboards a step's metrics go to: TensorBoard, Weights & Biases, MLflow and Comet, one small
class each. A sink owns its call and its naming quirks, which are upstream's (Megatron-Bridge's
training_log, its timer writers and ``_sanitize_mlflow_metrics``), so the dashboards read as upstream's:

- TensorBoard: one ``add_scalar`` per metric, and ``<name> vs samples`` for the groups drawn against
  the consumed samples; never ``samples vs steps`` (its x axis already is the step).
- W&B: ``log(group, step)``, one-element tensors as numbers (W&B would make a tensor a histogram);
  losses, timers, TFLOP/s and validation results one metric per call; no ``decoupled-learning-rate``.
- MLflow: ``log_metrics(group, step=)``; a name keeps its first ``/`` (later ones become ``_``), ``@``
  becomes ``_at_`` and what MLflow refuses ``_``, a timer's every ``/`` ``_``; the per-device TFLOP/s is
  ``throughput/tflops_per_device``, ``<loss> validation [ppl]`` is ``val/<loss> [ppl]``; no
  ``decoupled-learning-rate``.
- Comet: ``log_metrics(group, step=)``; no ``samples vs steps``, no ``decoupled-learning-rate``.

As upstream, a tracking server (MLflow, Comet) that fails to take the timers costs a warning; any
other failure is the run's.
"""

from __future__ import annotations

import re
import warnings

from megatron_lite.training.metrics.step_metrics import (
    LOSSES,
    TFLOPS,
    TIMERS,
    VALIDATION,
    MetricGroup,
    StepMetrics,
)


def _number(value):
    return value.item() if hasattr(value, "numel") and value.numel() == 1 else value


class Sink:
    """One dashboard: ``write`` a step's metrics with its own call, skipping what upstream never sends it."""

    name = ""
    skips: frozenset[str] = frozenset()

    def __init__(self, logger):
        self.logger = logger
        """The logger object GlobalState made (a SummaryWriter, the wandb module, ...)."""

    def write(self, metrics: StepMetrics) -> None:
        for group in metrics.dashboard_groups:
            values = {k: v for k, v in group.values.items() if k not in self.skips}
            if values:
                self.write_group(group, values, metrics)

    def write_group(self, group: MetricGroup, values: dict, metrics: StepMetrics) -> None:
        raise NotImplementedError


class TensorBoardSink(Sink):
    name = "TensorBoard"
    skips = frozenset({"samples vs steps"})

    def write_group(self, group, values, metrics):
        for key, value in values.items():
            self.logger.add_scalar(key, value, metrics.step)
            if group.vs_samples and metrics.samples is not None:
                self.logger.add_scalar(f"{key} vs samples", value, metrics.samples)


class WandbSink(Sink):
    name = "W&B"
    skips = frozenset({"decoupled-learning-rate"})
    one_metric_per_call = frozenset({LOSSES, TIMERS, TFLOPS, VALIDATION})

    def write_group(self, group, values, metrics):
        numbers = {k: _number(v) for k, v in values.items()}
        for part in (
            [{k: v} for k, v in numbers.items()] if group.kind in self.one_metric_per_call else [numbers]
        ):
            self.logger.log(part, metrics.step)


class _TrackingServerSink(Sink):
    """MLflow and Comet: ``log_metrics(values, step=)``."""

    def write_group(self, group, values, metrics):
        values = self.rename(group, {k: _number(v) for k, v in values.items()})
        if group.kind != TIMERS:
            self.logger.log_metrics(values, step=metrics.step)
            return
        try:
            self.logger.log_metrics(values, step=metrics.step)
        except Exception:  # upstream's rule for timers: a tracking-server hiccup must not stop training
            warnings.warn(
                f"Failed to log timer metrics to {self.name}; continuing without timer metrics.", stacklevel=4
            )

    def rename(self, group: MetricGroup, values: dict) -> dict:
        return values


def mlflow_name(key: str) -> str:
    """Upstream's ``_sanitize_mlflow_metrics`` for one name: MLflow's file store makes each ``/`` a
    folder, so only the first stays (``a/b`` and ``a/b/c`` cannot both be metrics)."""
    key = re.sub(r"/+", "/", key.replace("@", "_at_"))
    if "/" in key:
        first, rest = key.split("/", 1)
        key = first + "/" + rest.replace("/", "_")
    return re.sub(r"[^/\w.\- :]", "_", key)


class MlflowSink(_TrackingServerSink):
    name = "MLFlow"
    skips = frozenset({"decoupled-learning-rate"})
    renames = {"throughput/tflops/device": "throughput/tflops_per_device"}

    def rename(self, group, values):
        if group.kind == TIMERS:
            return {k.replace("/", "_"): v for k, v in values.items()}
        if group.kind == VALIDATION:  # upstream's eval: "val/<loss>", "val/<loss> ppl"
            values = {"val/" + k.replace(" validation", "", 1): v for k, v in values.items()}
        return {mlflow_name(self.renames.get(k, k)): v for k, v in values.items()}


class CometSink(_TrackingServerSink):
    name = "Comet ML"
    skips = frozenset({"samples vs steps", "decoupled-learning-rate"})
