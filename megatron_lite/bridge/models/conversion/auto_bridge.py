"""AutoBridge: a Hugging Face model directory in and out of megatron_lite, at any TP / PP layout, as
Megatron-Bridge's ``megatron.bridge.AutoBridge``. Local directories only: nothing is downloaded.

    bridge = AutoBridge.from_hf_pretrained("/models/Llama-3.1-8B")
    provider = bridge.to_megatron_provider()   # a GPTModelProvider from config.json; provide() loads
    chunks = [provider.provide()]              # this rank's stage, its weights read from the files
    bridge.save_hf_pretrained(chunks, "/out")   # collective: config, sharded safetensors, tokenizer
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.conversion.hf_config import read_config
from megatron_lite.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron_lite.bridge.models.hf_pretrained.safe_tensors import SafeTensorsCheckpoint, ShardedWriter
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.utils.atomic_io import replace_directory, write_error_line

# What transformers' save_pretrained writes beside the weights, copied from the source as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _chunks(model) -> list:
    """The model chunks, unwrapped from DDP (``.module``) as Megatron-Bridge's unwrap_model does."""
    chunks = model if isinstance(model, list) else [model]
    unwrapped = []
    for chunk in chunks:
        while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped


def _reason(err: Exception) -> str:
    if isinstance(err, OSError):
        return write_error_line(err)
    return f"{type(err).__name__}: {err}".splitlines()[0]


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class AutoBridge:
    """One Hugging Face model directory and the family bridge that reads it."""

    def __init__(self, path: str, hf_config: dict, model_bridge: MegatronModelBridge):
        self.hf_path, self.hf_config, self._model_bridge = path, hf_config, model_bridge

    @classmethod
    def list_supported_models(cls) -> list[str]:
        return MegatronModelBridge.supported_model_types()

    @classmethod
    def supports(cls, config: dict) -> bool:
        return config.get("model_type") in MegatronModelBridge.supported_model_types()

    @classmethod
    def from_hf_pretrained(cls, path: str, **kwargs) -> AutoBridge:
        """A bridge for the model in local directory ``path`` (config.json and safetensors weights).
        Reads config.json only; the weights are read when a model is loaded."""
        if kwargs.get("trust_remote_code"):
            raise BridgeError("trust_remote_code: megatron_lite runs no code from a model directory")
        path = os.fspath(path)
        config = read_config(path)
        bridge = MegatronModelBridge.for_model_type(config.get("model_type"))()
        return cls(path, config, bridge)

    def to_megatron_provider(self, load_weights: bool = True, hf_path: str | None = None) -> GPTModelProvider:
        """A GPTModelProvider of config.json's architecture; with ``load_weights`` each model it
        provides is filled with this rank's shard of the weights (of ``hf_path`` when given)."""
        provider = self._model_bridge.provider_bridge(self.hf_config)
        # transformers >= 4.56 writes "dtype", earlier versions "torch_dtype".
        dtype = self.hf_config.get("dtype", self.hf_config.get("torch_dtype"))
        provider.params_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            dtype, torch.float32
        )
        if load_weights:
            provider.perform_initialization = False  # every weight is read from the files: no random init
            provider.register_pre_wrap_hook(lambda chunks: self.load_hf_weights(chunks, hf_path))
        return provider

    def _checkpoint(self, hf_path: str | None) -> SafeTensorsCheckpoint:
        return SafeTensorsCheckpoint(
            os.fspath(hf_path or self.hf_path), self._model_bridge.optional_hf_prefix
        )

    def load_hf_weights(self, model, hf_path: str | None = None, show_progress: bool = False):
        """Copy the Hugging Face weights into this rank's model chunks: each rank reads only its own
        layers' rows or columns of its TP shard, straight from the memory-mapped files. Not collective."""
        chunks = _chunks(model)
        config = chunks[0].config
        self._model_bridge.load_weights_hf_to_megatron(
            self._checkpoint(hf_path), chunks, config, show_progress
        )
        return model

    def export_hf_weights(self, model, cpu: bool = True, show_progress: bool = False):
        """(Hugging Face name, whole tensor) for every weight, yielded on every rank. Collective over
        the TP and PP groups: every rank must consume the whole iterator."""
        chunks = _chunks(model)
        stream = self._model_bridge.stream_weights_megatron_to_hf(chunks, chunks[0].config, cpu=cpu)
        for i, (name, tensor) in enumerate(stream):
            if show_progress and _rank0():
                print(f" exported {name} {tuple(tensor.shape)} ({i + 1})", flush=True)
            yield name, tensor

    def save_hf_pretrained(
        self, model, path: str, show_progress: bool = False, max_shard_size: int = 2 * 1024**3
    ) -> None:
        """Write a directory ``transformers`` loads: config.json, sharded safetensors (an index when
        more than one file) and a copy of the source's tokenizer files. Collective over the world;
        rank 0 writes into a temporary directory that replaces ``path`` only once complete."""
        path = os.path.abspath(os.fspath(path))
        chunks = _chunks(model)
        config = chunks[0].config
        temp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
        error, writer, dtype = None, None, None
        if _rank0():
            try:
                shutil.rmtree(temp, ignore_errors=True)
                os.makedirs(temp)
                writer = ShardedWriter(temp, max_shard_size)
            except OSError as err:
                error = f"{path}: cannot write ({_reason(err)})"
        for name, tensor in self.export_hf_weights(chunks, show_progress=show_progress):
            dtype = tensor.dtype
            if writer is not None and error is None:
                try:
                    writer.add(name, tensor)
                except Exception as err:  # safetensors raises its own error for a failed write
                    error = f"{path}: writing the weights failed ({_reason(err)})"
        if writer is not None and error is None:
            try:
                self._finish(writer, temp, path, config, dtype)
            except Exception as err:  # every rank must reach the broadcast below
                error = str(err) if isinstance(err, BridgeError) else f"{path}: {_reason(err)}"
        if _rank0() and error is not None:
            shutil.rmtree(temp, ignore_errors=True)
        if dist.is_initialized():
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise BridgeError(error + "; nothing was replaced")

    def _finish(self, writer: ShardedWriter, temp: str, path: str, config, dtype) -> None:
        writer.close()
        hf = self._model_bridge.megatron_to_hf_config(self.hf_config, config)
        if dtype in _DTYPE_NAMES:
            hf["dtype" if "dtype" in hf else "torch_dtype"] = _DTYPE_NAMES[dtype]
        with open(os.path.join(temp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        for name in TOKENIZER_FILES:
            source = os.path.join(self.hf_path, name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(temp, name))
        for name in os.listdir(temp):
            with open(os.path.join(temp, name), "rb") as f:
                os.fsync(f.fileno())
        replace_directory(temp, path, stale_suffix=f".old-{int(time.time())}")
