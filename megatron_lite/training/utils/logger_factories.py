"""Create each experiment logger from LoggerConfig. GlobalState decides when and on which rank (the
last one); these functions only build the sink, importing its package on first use."""

from __future__ import annotations

import os
import warnings
from typing import Any


def safe_serialize(obj: Any) -> str:
    """``str(obj)`` for a JSON dump of the config; ``<TypeName>`` when str() fails or is no string."""
    try:
        text = str(obj)
    except Exception:
        return f"<{type(obj).__name__}>"
    return text if isinstance(text, str) else f"<{type(obj).__name__}>"


def _flatten(d: dict, parent: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists become lists of strings (MLflow param values)."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{parent}.{key}" if parent else str(key)
        if isinstance(value, dict):
            flat.update(_flatten(value, name))
        else:
            flat[name] = [safe_serialize(v) for v in value] if isinstance(value, (list, tuple)) else value
    return flat


def make_tensorboard_writer(lg, resumed_step: int):
    """A SummaryWriter on lg.tensorboard_dir; after a resume at ``resumed_step`` it drops the events a
    crashed earlier run wrote past that step, so no step appears twice."""
    from torch.utils.tensorboard.writer import SummaryWriter

    kwargs = {"log_dir": lg.tensorboard_dir, "max_queue": lg.tensorboard_queue_size}
    if resumed_step > 0:
        kwargs["purge_step"] = resumed_step + 1
    return SummaryWriter(**kwargs)


def make_wandb(cfg, config_dict: dict):
    """``wandb`` with a run initialised (offline when WANDB_MODE=offline), files under
    wandb_save_dir, else <checkpoint.save>/wandb, else W&B's default."""
    import wandb

    lg = cfg.logger
    save_dir = lg.wandb_save_dir or (
        os.path.join(cfg.checkpoint.save, "wandb") if cfg.checkpoint.save else None
    )
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    if "WANDB_API_KEY" in os.environ:  # a pasted key often carries a newline
        os.environ["WANDB_API_KEY"] = os.environ["WANDB_API_KEY"].strip()
    # Training prints its own console lines: keep W&B from capturing or adding to them.
    os.environ.setdefault("WANDB_CONSOLE", "off")
    os.environ.setdefault("WANDB_SILENT", "true")
    wandb.init(
        dir=save_dir,
        name=lg.wandb_exp_name,
        project=lg.wandb_project,
        config=config_dict,
        entity=lg.wandb_entity,
    )
    return wandb


def make_mlflow(lg, config_dict: dict):
    """``mlflow`` with a run active: a new one named lg.mlflow_run_name, or the already active run
    (given lg.mlflow_tags); the config is logged as flattened run parameters."""
    import mlflow

    uri = lg.mlflow_tracking_uri
    if uri:
        if uri.startswith("file:") or "://" not in uri:
            # Asking for a file store is asking for it: MLflow 3 otherwise refuses one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(lg.mlflow_experiment)
    tags = getattr(lg, "mlflow_tags", None) or {}
    if mlflow.active_run() is None:
        mlflow.start_run(
            run_name=lg.mlflow_run_name,
            tags=tags or None,
            description=getattr(lg, "mlflow_description", None),
        )
    elif tags:
        mlflow.set_tags(tags)
    params = {
        k: v if isinstance(v, (int, float, bool, str)) else safe_serialize(v)
        for k, v in _flatten(config_dict).items()
    }
    mlflow.log_params(params)
    return mlflow


def make_comet(lg, config_dict: dict):
    """A comet_ml Experiment named lg.comet_experiment_name (an OfflineExperiment when
    lg.comet_offline_directory is set), tagged and given the config as parameters."""
    import comet_ml

    common: dict[str, Any] = {
        "project_name": lg.comet_project,
        "auto_metric_logging": False,
        "auto_output_logging": False,
        "log_env_details": False,
        "log_git_metadata": False,
        "log_git_patch": False,
        "log_env_gpu": False,
        "log_env_host": False,
        "display_summary_level": 0,
    }
    if lg.comet_workspace:
        common["workspace"] = lg.comet_workspace
    api_key = getattr(lg, "comet_api_key", None) or os.environ.get("COMET_API_KEY")
    if api_key:
        common["api_key"] = api_key.strip()
    if lg.comet_offline_directory:
        os.makedirs(lg.comet_offline_directory, exist_ok=True)
        experiment = comet_ml.OfflineExperiment(offline_directory=lg.comet_offline_directory, **common)
    else:
        experiment = comet_ml.Experiment(**common)
    experiment.set_name(lg.comet_experiment_name)
    if tags := getattr(lg, "comet_tags", None):
        experiment.add_tags(list(tags))
    try:
        experiment.log_parameters(config_dict)
    except Exception:  # parameters are a convenience; the run's metrics are what matters
        warnings.warn("Failed to log the config to Comet ML; continuing without it.", stacklevel=2)
    return experiment
