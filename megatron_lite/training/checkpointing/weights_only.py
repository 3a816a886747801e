"""A checkpoint of weights only, in Megatron's layout: what an import from Hugging Face writes
(iteration 0, the architecture recorded, no optimizer). ``--pretrained-checkpoint`` (or ``--finetune``)
loads it at any layout; ``--use-checkpoint-args`` takes the architecture from it."""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.layout import (
    CHECKPOINT_VERSION,
    METADATA,
    TRACKER,
    parallel_layout,
)
from megatron_lite.training.checkpointing.safety import plain
from megatron_lite.training.checkpointing.save import _commit, _model_state, write_shard
from megatron_lite.utils.atomic_io import atomic_write_bytes, write_error_line


def save_model_weights(root: str, model, model_config, iteration: int = 0) -> None:
    """Write this rank's weights under ``root`` (``iter_XXXXXXX/mp_rank_..``, metadata.json, tracker),
    with ``model_config`` recorded as the checkpoint's ``config["model"]``. Collective over the world;
    a failed write anywhere is one CheckpointError everywhere, the previous checkpoint untouched."""
    tmp_root = os.path.join(root, f".tmp_iter_{iteration:07d}")
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp_root, ignore_errors=True)
            os.makedirs(tmp_root)
        except OSError as err:
            error = f"{root}: cannot write the checkpoint, {write_error_line(err)}"
    agree(error)
    try:
        if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
            payload = {
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": iteration,
                **_model_state(model),
                "parallel_layout": parallel_layout(),
                "config": {"model": plain(model_config)},
            }
            write_shard(tmp_root, payload)
        if dist.get_rank() == 0:
            metadata = json.dumps(
                {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION, **parallel_layout()}
            )
            atomic_write_bytes(os.path.join(tmp_root, METADATA), lambda f: f.write(metadata.encode()))
    except OSError as err:
        error = f"{root}: the checkpoint was not written, {write_error_line(err)}"
    agree(error, cleanup=tmp_root)
    if dist.get_rank() == 0:
        try:
            _commit(root, tmp_root, iteration)
            atomic_write_bytes(os.path.join(root, TRACKER), lambda f: f.write(f"{iteration}\n".encode()))
        except OSError as err:
            shutil.rmtree(tmp_root, ignore_errors=True)
            error = f"{root}: the checkpoint was not written, {write_error_line(err)}"
    agree(error)
