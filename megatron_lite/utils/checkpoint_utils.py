"""The filesystem questions (upstream: ``megatron.bridge.training.utils.checkpoint_utils``, importable there)
the checkpoint config asks before any worker starts."""

from __future__ import annotations

import os


def file_exists(path: str) -> bool:
    """Whether ``path`` (a file or a directory) exists on the local or shared filesystem."""
    return os.path.exists(path)


def get_hf_model_id_from_checkpoint(path: str) -> str | None:
    """The Hugging Face model id a checkpoint's ``run_config.yaml`` records (``model.hf_model_id``,
    in the root or its latest ``iter_*``); None where it records none."""
    import yaml

    candidates = [os.path.join(path, "run_config.yaml")]
    if os.path.isdir(path):
        iters = sorted(
            (d for d in os.listdir(path) if d.startswith("iter_") and d[5:].isdigit()),
            key=lambda d: int(d[5:]),
        )
        candidates += [os.path.join(path, d, "run_config.yaml") for d in reversed(iters)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            with open(candidate) as f:
                model = (yaml.safe_load(f) or {}).get("model") or {}
            value = model.get("hf_model_id") if isinstance(model, dict) else None
            return str(value) if value else None
    return None
