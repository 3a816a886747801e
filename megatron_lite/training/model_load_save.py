"""Megatron-Bridge's ``megatron.bridge.training.model_load_save``: a megatron checkpoint's model in and
out outside a training run. ``temporary_distributed_context`` gives a one-process world (gloo) for a
conversion started without one; the save writes iteration 0 as ``--save`` does (checkpointing/)."""

from __future__ import annotations

import os
import shutil
import socket
from contextlib import contextmanager, nullcontext
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.core.utils import unwrap_model
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.training.checkpointing.layout import (
    get_checkpoint_name,
    is_distributed_checkpoint,
    read_common,
    read_metadata,
    read_shard,
    read_tracker,
)
from megatron_lite.training.checkpointing.load import load_model_state
from megatron_lite.training.checkpointing.safety import CheckpointError
from megatron_lite.training.checkpointing.torch_dist import load_distributed_weights
from megatron_lite.training.checkpointing.weights_only import save_model_weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def temporary_distributed_context(backend: str = "gloo"):
    """A one-rank world and model-parallel state of size 1 for the block; both torn down after."""
    # Its own address, not the environment's: the caller's MASTER_* stay as they were.
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def save_megatron_model(
    model, path, hf_tokenizer_path=None, low_memory_save=False, hf_tokenizer_kwargs=None
) -> None:
    """Write the model chunks as iteration 0 of ``path`` (collective), with the tokenizer directory's
    files beside it under ``tokenizer/`` when ``hf_tokenizer_path`` is a local directory.
    ``low_memory_save`` changes nothing here: each rank writes its own shard as it holds it."""
    chunks = [unwrap_model(chunk) for chunk in (model if isinstance(model, list) else [model])]
    save_model_weights(os.fspath(path), chunks, chunks[0].config, iteration=0, flag="path")
    if (
        hf_tokenizer_path is not None
        and os.path.isdir(hf_tokenizer_path)
        and (not dist.is_initialized() or dist.get_rank() == 0)
    ):
        target = Path(path) / "tokenizer"
        target.mkdir(parents=True, exist_ok=True)
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "vocab.json",
            "merges.txt",
        ):
            if os.path.isfile(os.path.join(hf_tokenizer_path, name)):
                shutil.copyfile(os.path.join(hf_tokenizer_path, name), target / name)


def _root_and_iteration(checkpoint_path) -> tuple[str, int]:
    """A checkpoint root (its latest iteration) or one of its ``iter_*`` directories."""
    path = os.path.abspath(os.fspath(checkpoint_path))
    name = os.path.basename(path)
    if name.startswith("iter_") and name[5:].isdigit():
        return os.path.dirname(path), int(name[5:])
    iteration = read_tracker(path, flag="checkpoint_path")
    if iteration is None:
        raise CheckpointError(f"checkpoint_path {path}: holds no checkpoint")
    return path, iteration


def _saved_config(root: str, iteration: int) -> dict:
    if is_distributed_checkpoint(root, iteration, flag="checkpoint_path"):
        return read_common(root, iteration, flag="checkpoint_path").get("config") or {}
    pp = read_metadata(root, iteration, flag="checkpoint_path").get("pipeline_model_parallel_size", 1)
    shard = get_checkpoint_name(root, iteration, 0, 0, pp)
    return read_shard(shard, root, flag="checkpoint_path", mmap=True).get("config") or {}


def load_model_config(checkpoint_path):
    """(model provider, None): the model config a megatron_lite checkpoint recorded (``common.pt`` of a
    ``torch_dist`` checkpoint, the shard of a legacy one; Megatron-Bridge reads ``run_config.yaml``),
    read without running code from it. The second item is Megatron-LM's args, which it has none of."""
    root, iteration = _root_and_iteration(checkpoint_path)
    saved = _saved_config(root, iteration).get("model")
    if not saved:
        raise CheckpointError(f"checkpoint_path {root}: iteration {iteration} records no model config")
    names = {f.name for f in fields(GPTModelProvider) if f.init}
    # The checkpoint names its callables: the activation is looked up by name, the init methods
    # are left to the provider (every weight comes from the checkpoint).
    values = {
        k: v for k, v in saved.items() if k in names and k not in ("init_method", "output_layer_init_method")
    }
    if isinstance(values.get("activation_func"), str):
        values["activation_func"] = _activation(values["activation_func"], root)
    return GPTModelProvider(**values), None


def _activation(name: str, root: str):
    from megatron_lite.core import activations

    for namespace in (activations, torch.nn.functional):
        if callable(getattr(namespace, name, None)):
            return getattr(namespace, name)
    raise CheckpointError(f"checkpoint_path {root}: its activation {name!r} is not one megatron_lite has")


def load_megatron_model(checkpoint_path, model_type=None, return_state_dict=False, use_cpu_init=True,
                        skip_temp_dist_context=None, mp_overrides=None):  # fmt: skip
    """The model chunks of a megatron_lite checkpoint (root or ``iter_*``), built from the config it
    recorded at this world's tensor / pipeline layout (``mp_overrides`` sets provider fields first)
    and filled with its weights; their state dict instead with ``return_state_dict``. Collective over
    the world; without one (and unless ``skip_temp_dist_context``), in a one-rank gloo world."""
    del model_type  # GPT only here
    skip = dist.is_initialized() if skip_temp_dist_context is None else skip_temp_dist_context
    with nullcontext() if skip else temporary_distributed_context("gloo"):
        root, iteration = _root_and_iteration(checkpoint_path)
        provider, _ = load_model_config(checkpoint_path)
        for name, value in (mp_overrides or {}).items():
            setattr(provider, name, value)
        provider.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
        provider.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
        provider.use_cpu_initialization = bool(use_cpu_init)
        provider.perform_initialization = False  # every weight is read from the checkpoint next
        vp = provider.virtual_pipeline_model_parallel_size
        chunks = [provider.provide(vp_stage=i if vp else None) for i in range(vp or 1)]
        if is_distributed_checkpoint(root, iteration, flag="checkpoint_path"):
            load_distributed_weights(chunks, provider, root, iteration, flag="checkpoint_path")
        else:
            shard = get_checkpoint_name(
                root,
                iteration,
                parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_pipeline_model_parallel_world_size(),
            )
            load_model_state(chunks, read_shard(shard, root, flag="checkpoint_path", mmap=True))
        if return_state_dict:
            return {k: v for chunk in chunks for k, v in chunk.state_dict().items()}
        return chunks if len(chunks) > 1 else chunks[0]
