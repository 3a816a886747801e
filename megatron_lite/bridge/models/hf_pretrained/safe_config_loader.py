"""A local model directory's config.json as a config object: Megatron-Bridge's
``safe_load_config_with_retry``, without the hub, the lock files or the retries (nothing is downloaded,
and a local read has no race to retry).

The config is ``transformers``' own class for the ``model_type`` when ``transformers`` is installed
(its defaults fill keys ``save_pretrained`` left out, as upstream's), else a :class:`JSONConfig` of
the file's keys. Either way it is built from JSON only: no code in the directory is imported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_lite.bridge.models.conversion.errors import BridgeError

REMOTE_CODE_REFUSED = "trust_remote_code: megatron_lite runs no code from a model directory"


def local_model_dir(path: str | os.PathLike) -> Path:
    """``path`` as a local directory; a hub id or a missing path is one ValueError line."""
    local = Path(path)
    if not local.is_dir():
        raise BridgeError(
            f"{path}: not a directory (megatron_lite downloads nothing: a local Hugging Face model "
            "directory is needed; download it first, e.g. with `hf download`)"
        )
    return local


class JSONConfig:
    """config.json's keys as attributes, for machines without ``transformers``: the fields upstream's
    bridges read (``config.hidden_size``), ``to_dict`` and ``save_pretrained``."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    def __repr__(self) -> str:
        return f"JSONConfig(model_type={getattr(self, 'model_type', None)!r})"


def config_from_dict(values: dict, name_or_path: str | None = None):
    """The config object of a config.json's dict (see the module docstring for its class)."""
    try:
        from transformers import AutoConfig, PretrainedConfig
    except ImportError:
        return JSONConfig(**values, **({"_name_or_path": name_or_path} if name_or_path else {}))
    values = dict(values)
    model_type = values.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError, TypeError):
        # A model_type this transformers does not know, or values its class refuses: keep the keys as
        # they are, so the family bridge names the field it cannot read in megatron_lite's words.
        config = PretrainedConfig(**values)
        if model_type is not None:
            config.model_type = model_type
    if name_or_path:
        config._name_or_path = str(name_or_path)
    return config


def safe_load_config_with_retry(path: str | os.PathLike, trust_remote_code: bool = False, **kwargs):
    """config.json of the local directory ``path``. ``max_retries`` / ``base_delay`` and the other
    ``from_pretrained`` keywords upstream passes on are accepted and have nothing to do here. Raises
    ValueError ("Failed to load configuration ...") for what cannot be read."""
    if trust_remote_code:
        raise BridgeError(f"Failed to load configuration from {path}: {REMOTE_CODE_REFUSED}")
    directory = local_model_dir(path)
    try:
        with open(directory / "config.json") as f:
            values = json.load(f)
    except FileNotFoundError:
        raise BridgeError(f"Failed to load configuration: {path}: has no config.json") from None
    except (OSError, ValueError) as err:
        raise BridgeError(
            f"Failed to load configuration: {path}/config.json: unreadable ({type(err).__name__})"
        ) from None
    if not isinstance(values, dict):
        raise BridgeError(f"Failed to load configuration: {path}/config.json: not a JSON object")
    try:
        return config_from_dict(values, str(path))
    except Exception as err:  # transformers' config classes validate (rope_scaling, head sizes)
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        raise BridgeError(
            f"config.json: cannot be read as a {values.get('model_type')} model ({reason})"
        ) from None
