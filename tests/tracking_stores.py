"""What a run wrote to MLflow's file store and to Comet's offline archive, read back as
name -> {step: value} (TensorBoard's and W&B's readers are event_files.py and wandb_offline.py)."""

from __future__ import annotations

import json
import zipfile


def mlflow_metrics(tracking_uri: str, experiment: str) -> dict[str, dict[int, float]]:
    """Set MLFLOW_ALLOW_FILE_STORE=true before calling (newer MLflow asks it of a file store)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {
        name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        for name in run.data.metrics
    }


def comet_metrics(archive) -> dict[str, dict[int, float]]:
    """The metric messages of an offline experiment's zip (``messages.json``: one JSON per line)."""
    metrics: dict[str, dict[int, float]] = {}
    with zipfile.ZipFile(archive) as z:
        for line in z.read("messages.json").splitlines():
            payload = json.loads(line).get("payload")
            metric = payload.get("metric") if isinstance(payload, dict) else None
            if isinstance(metric, dict):
                metrics.setdefault(metric["metricName"], {})[metric["step"]] = metric["metricValue"]
    return metrics
