"""Writing megatron model chunks' weights into a Hugging Face model directory: sharded safetensors
with the index ``transformers`` reads, each file complete before it gets its final name. What
``AutoBridge.save_hf_weights`` runs; collective over the world (every rank streams, rank 0 writes)."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from megatron_lite.bridge.models.conversion.errors import BridgeError, raise_rank0_error
from megatron_lite.bridge.models.conversion.utils import unwrap_model
from megatron_lite.bridge.models.hf_pretrained.safe_tensors import ShardedWriter
from megatron_lite.utils.atomic_io import write_error_line


def _reason(err: Exception) -> str:
    if isinstance(err, OSError):
        return write_error_line(err)
    return f"{type(err).__name__}: {err}".splitlines()[0]


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def source_config(bridge) -> dict:
    """The source's config.json as a dict: the file as written where there is one (every key kept),
    else the config object's dict."""
    hf = bridge.hf_pretrained
    directory = getattr(hf, "model_name_or_path", None)
    if directory and os.path.isfile(os.path.join(directory, "config.json")):
        with open(os.path.join(directory, "config.json")) as f:
            return json.load(f)
    return getattr(hf, "config", hf).to_dict()


def write_hf_weights(
    bridge, model, path, show_progress: bool, max_shard_size: int, weight_dtype=None
) -> None:
    """Every weight of the model chunks into ``path`` as safetensors files of at most
    ``max_shard_size`` bytes (an index when more than one), the model first checked to be the one
    the source config describes. Collective: every rank streams, rank 0 writes; any failure is one
    BridgeError line on every rank, and no weights file is left half written."""
    path = os.path.abspath(os.fspath(path))
    chunks = unwrap_model(model if isinstance(model, list) else [model])
    error, writer = None, None
    if _rank0():
        try:
            bridge._model_bridge.source_config_checked(source_config(bridge), chunks[0].config)
            os.makedirs(path, exist_ok=True)
            writer = ShardedWriter(path, max_shard_size)
        except BridgeError as err:
            error = str(err)
        except OSError as err:
            error = f"{path}: cannot write ({_reason(err)})"
    stream = bridge.export_hf_weights(chunks, show_progress=show_progress, weight_dtype=weight_dtype)
    for name, tensor in stream:
        if writer is not None and error is None:
            try:
                writer.add(name, tensor)
            except Exception as err:  # safetensors raises its own error for a failed write
                error = f"{path}: writing the weights failed ({_reason(err)})"
    if writer is not None and error is None:
        try:
            for name in writer.close():
                with open(os.path.join(path, name), "rb") as f:
                    os.fsync(f.fileno())
        except Exception as err:  # every rank must reach the broadcast below
            error = f"{path}: {_reason(err)}"
    raise_rank0_error(error)
