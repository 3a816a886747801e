"""A local Hugging Face model directory as pretrain.py's ``--pretrained-checkpoint``: the architecture
from its config.json (what ``--use-checkpoint-args`` takes, as ``checkpoint_conversion.py import``
builds it) and its weights read straight into the built model chunks at any tp / pp / ep layout, each
rank reading its own shard. Training sits below the bridge: ``register()`` hands these two functions
to ``megatron_lite.training.checkpointing.hf_directory``."""

from __future__ import annotations

from megatron_lite.bridge.models.conversion.auto_bridge import AutoBridge
from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.conversion.utils import unwrap_model
from megatron_lite.training.checkpointing import hf_directory
from megatron_lite.training.checkpointing.compat import resharded_model_error
from megatron_lite.training.checkpointing.safety import CheckpointError, plain

FLAG = "--pretrained-checkpoint"


def _bridge(path: str) -> AutoBridge:
    try:
        return AutoBridge.from_hf_pretrained(path)
    except BridgeError as err:
        raise CheckpointError(f"{FLAG} {path}: {err}") from None


def hf_directory_model(path: str) -> dict:
    """The model config the directory's config.json makes (a saved config's ``model`` section)."""
    try:
        provider = _bridge(path).to_megatron_provider(load_weights=False)
    except BridgeError as err:
        raise CheckpointError(f"{FLAG} {path}: {err}") from None
    return plain(provider)


def load_hf_directory(path: str, model, model_config) -> None:
    """This rank's shard of every base weight, read from the directory's safetensors into the model
    chunks (DDP-wrapped or not; a LoRA-wrapped layer's base, never its adapter). CheckpointError, one
    line, when config.json is not this run's architecture or a tensor does not fit. Not collective."""
    saved = {"model": hf_directory_model(path)}
    error = resharded_model_error(path, saved, model_config)
    if error:
        error = error.replace(f"--load {path}", f"{FLAG} {path}").replace(
            "the checkpoint's model", "its config.json"
        )
        error = error.replace("use the saved architecture's flags", "give its architecture's flags")
        raise CheckpointError(f"{error} (or --use-checkpoint-args)")
    chunks = unwrap_model(model if isinstance(model, list) else [model])
    try:
        _bridge(path).load_hf_weights(chunks)
    except BridgeError as err:
        raise CheckpointError(f"{FLAG} {path}: {err}") from None


def register() -> None:
    hf_directory.register_hf_directory_loader(lambda: (hf_directory_model, load_hf_directory))
