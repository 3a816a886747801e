"""One metrics dict, fanned out to every configured sink (TensorBoard, W&B, MLflow, Comet)."""

from __future__ import annotations

import re

_MLFLOW_UNSAFE = re.compile(r"[^0-9A-Za-z_\-. /:]")


class MetricsWriter:
    """Writes each metric once to all sinks. With no sinks (every rank but the last) it does nothing,
    so callers never check ranks or sinks per metric."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    @classmethod
    def from_state(cls, state) -> MetricsWriter:
        sinks = []
        if (tb := state.tensorboard_logger) is not None:
            sinks.append(lambda m, step: [tb.add_scalar(k, v, step) for k, v in m.items()])
        if (run := state.wandb_logger) is not None:
            sinks.append(lambda m, step: run.log(m, step=step))
        if (mlflow := state.mlflow_logger) is not None:
            sinks.append(
                lambda m, step: mlflow.log_metrics(
                    {_MLFLOW_UNSAFE.sub("_", k): v for k, v in m.items()}, step=step
                )
            )
        if (comet := state.comet_logger) is not None:
            sinks.append(lambda m, step: comet.log_metrics(m, step=step))
        return cls(sinks)

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def write(self, metrics: dict[str, float], step: int) -> None:
        if not metrics:
            return
        for sink in self.sinks:
            sink(metrics, step)
