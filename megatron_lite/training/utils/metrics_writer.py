"""One metrics dict, fanned out to the configured sinks (TensorBoard, W&B, MLflow, Comet) with each
sink's own call, as upstream's training_log makes them."""

from __future__ import annotations

import re

_MLFLOW_UNSAFE = re.compile(r"[^0-9A-Za-z_\-. /:]")
SINKS = ("tensorboard", "wandb", "mlflow", "comet")


def _number(value):
    return value.item() if hasattr(value, "numel") and value.numel() == 1 else value


class MetricsWriter:
    """Writes each metric once to the chosen sinks. With no sinks (every rank but the last) it does
    nothing, so callers never check ranks or sinks per metric."""

    def __init__(self, tensorboard=None, wandb=None, mlflow=None, comet=None):
        self.tensorboard = tensorboard
        """A SummaryWriter-like object (``add_scalar(tag, value, step)``), or None."""
        self.wandb = wandb
        """A W&B run (``log(metrics, step)``), or None."""
        self.mlflow = mlflow
        """The mlflow module or a client with ``log_metrics(metrics, step=)``, or None."""
        self.comet = comet
        """A Comet experiment (``log_metrics(metrics, step=)``), or None."""

    @classmethod
    def from_state(cls, state) -> MetricsWriter:
        return cls(
            tensorboard=state.tensorboard_logger,
            wandb=state.wandb_logger,
            mlflow=getattr(state, "mlflow_logger", None),
            comet=getattr(state, "comet_logger", None),
        )

    def __bool__(self) -> bool:
        return any(sink is not None for sink in (self.tensorboard, self.wandb, self.mlflow, self.comet))

    def write(self, metrics: dict, step: int, *, samples: int | None = None, sinks=SINKS) -> None:
        """Write ``metrics`` at ``step`` to each of ``sinks`` that is configured. With ``samples``,
        TensorBoard also gets each metric as ``<name> vs samples`` at that x (upstream's extra curves)."""
        if not metrics:
            return
        if self.tensorboard is not None and "tensorboard" in sinks:
            for name, value in metrics.items():
                self.tensorboard.add_scalar(name, value, step)
                if samples is not None:
                    self.tensorboard.add_scalar(f"{name} vs samples", value, samples)
        if self.wandb is not None and "wandb" in sinks:
            # W&B would turn a tensor into a histogram: one-element tensors go as numbers.
            self.wandb.log({k: _number(v) for k, v in metrics.items()}, step)
        if self.mlflow is not None and "mlflow" in sinks:
            self.mlflow.log_metrics({_MLFLOW_UNSAFE.sub("_", k): v for k, v in metrics.items()}, step=step)
        if self.comet is not None and "comet" in sinks:
            self.comet.log_metrics(metrics, step=step)
