"""Hugging Face directory <-> megatron_lite checkpoint, on the ranks of a running world (what
``tools/checkpoint_conversion.py`` starts): Megatron-Bridge's ``import_ckpt`` / ``export_ckpt``."""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.core import parallel_state
from megatron_lite.training.checkpointing.compat import checkpoint_model_error, saved_split
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
from megatron_lite.utils.atomic_io import replace_directory


def saved_layout(megatron_path: str) -> tuple[int, dict]:
    """The latest iteration of a checkpoint and the layout that saved it (tp and pp sizes: the legacy
    format's metadata.json, a torch_dist checkpoint's common.pt)."""
    try:
        iteration = read_tracker(megatron_path, flag="--megatron-path")
        if iteration is None:
            raise BridgeError(f"--megatron-path {megatron_path}: holds no checkpoint")
        if is_distributed_checkpoint(megatron_path, iteration, flag="--megatron-path"):
            return iteration, read_common(megatron_path, iteration, flag="--megatron-path")["parallel_layout"]
        return iteration, read_metadata(megatron_path, iteration, flag="--megatron-path")
    except CheckpointError as err:
        raise BridgeError(str(err)) from None


def import_ckpt(bridge, megatron_path: str, show_progress: bool = False) -> None:
    """Build this rank's stage from the bridge's config.json, read its weights from the Hugging Face
    files, and write it as iteration 0 of ``megatron_path``. Collective; parallel_state initialized."""
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    provider.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    provider.perform_initialization = False  # every weight is read from the files next
    model = provider.provide()
    bridge.load_hf_weights([model], show_progress=show_progress)
    save_model_weights(megatron_path, [model], provider, iteration=0, flag="--megatron-path")


def export_provider(bridge, megatron_path: str, saved_config: dict | None):
    """The provider of the bridge's config.json at this world's layout with the checkpoint's layer
    split; BridgeError when config.json is not the checkpoint's architecture."""
    saved = (saved_config or {}).get("model") or {}
    if saved.get("pipeline_model_parallel_layout") is not None:
        raise BridgeError(
            f"--megatron-path {megatron_path}: exporting a --pipeline-model-parallel-layout run is not supported"
        )
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = saved.get("tensor_model_parallel_size", 1)
    provider.pipeline_model_parallel_size = saved.get("pipeline_model_parallel_size", 1)
    provider.perform_initialization = False  # the checkpoint's weights replace them
    for name, value in vars(saved_split(saved_config) or {}).items():
        if name != "num_layers":  # the architecture check compares config.json's with the saved one
            setattr(provider, name, value)
    error = checkpoint_model_error(megatron_path, saved_config, provider)
    if error:
        error = error.replace("--load", "--megatron-path").split("; use the")[0]
        raise BridgeError(f"{error}; --hf-model must be the model it was imported from")
    return provider


def export_ckpt(bridge, megatron_path: str, hf_path: str, show_progress: bool = False) -> None:
    """Load this rank's part of ``megatron_path``'s latest iteration (a legacy checkpoint: its shard
    saved at this world's layout; a torch_dist one: read at this layout) into a model of the bridge's
    config.json and write the Hugging Face directory. Collective."""
    iteration, _ = saved_layout(megatron_path)
    if is_distributed_checkpoint(megatron_path, iteration, flag="--megatron-path"):
        saved_config = read_common(megatron_path, iteration, flag="--megatron-path")["config"]
        chunks, provider = export_chunks(bridge, megatron_path, saved_config)
        try:
            load_distributed_weights(chunks, provider, megatron_path, iteration, flag="--megatron-path")
        except CheckpointError as err:
            raise BridgeError(str(err)) from None
    else:
        chunks = _load_legacy_shard(bridge, megatron_path, iteration)
    save_whole(bridge, chunks, hf_path, show_progress)


def save_whole(bridge, chunks, hf_path: str, show_progress: bool) -> None:
    """Write the directory beside ``hf_path`` and put it in place only once complete: a failed export
    leaves what was there. Collective (the save is; rank 0 names the directory and moves it)."""
    final = os.path.abspath(hf_path)
    box = [f"{os.path.dirname(final)}/.{os.path.basename(final)}.tmp-{os.getpid()}"]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    try:
        bridge.save_hf_pretrained(chunks, box[0], show_progress=show_progress)
    except BaseException:
        if rank0:
            shutil.rmtree(box[0], ignore_errors=True)
        raise
    if rank0:
        replace_directory(box[0], final)
    if dist.is_initialized():
        dist.barrier()


def export_chunks(bridge, megatron_path: str, saved_config: dict | None):
    provider = export_provider(bridge, megatron_path, saved_config)
    vp = provider.virtual_pipeline_model_parallel_size
    return [provider.provide(vp_stage=i if vp else None) for i in range(vp or 1)], provider


def rank_shard_name(megatron_path: str, iteration: int) -> str:
    """This rank's ``model_optim_rng.pt`` of a legacy-format checkpoint saved at this world's layout."""
    return get_checkpoint_name(
        megatron_path,
        iteration,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def _load_legacy_shard(bridge, megatron_path: str, iteration: int) -> list:
    """This rank's model chunks, filled from its ``model_optim_rng.pt`` (saved at this layout)."""
    shard = rank_shard_name(megatron_path, iteration)
    try:
        payload = read_shard(shard, megatron_path, flag="--megatron-path", mmap=True)
    except FileNotFoundError:
        raise BridgeError(f"--megatron-path {megatron_path}: iteration {iteration} has no {shard}") from None
    except CheckpointError as err:
        raise BridgeError(str(err)) from None
    chunks, _ = export_chunks(bridge, megatron_path, payload.get("config"))
    try:
        load_model_state(chunks, payload)
    except (ValueError, RuntimeError) as err:
        raise BridgeError(
            f"--megatron-path {megatron_path}: {shard} does not fit the model ({str(err).splitlines()[0]})"
        ) from None
    del payload  # its mapped pages would count against this rank for the whole export
    return chunks
