"""Saving: every shard into a temporary directory, renamed into place once all are on disk, the
tracker replaced last. A crash or a failed write mid-save leaves the previous checkpoint and tracker
untouched."""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.distrib_optim import (
    get_distributed_optimizer_checkpoint_name,
    uses_distributed_optimizer,
)
from megatron_lite.training.checkpointing.layout import (
    CHECKPOINT_VERSION,
    METADATA,
    TRACKER,
    model_keys,
    my_shard_name,
    parallel_layout,
)
from megatron_lite.training.checkpointing.rng import rng_state
from megatron_lite.training.checkpointing.safety import plain
from megatron_lite.utils.atomic_io import atomic_write_bytes, fsync_dir, replace_directory, write_error_line

# Fault-injection tests widen the window between writing the shards and committing them.
_TEST_DELAY_BEFORE_COMMIT_S = float(os.environ.get("MEGATRON_LITE_TEST_SAVE_DELAY_S", "0"))


def model_chunks(model) -> list:
    return model if isinstance(model, list) else [model]


def _model_state(model) -> dict:
    chunks = model_chunks(model)
    return {key: chunk.state_dict() for key, chunk in zip(model_keys(len(chunks)), chunks)}


def _nbytes(obj) -> int:
    """About what ``torch.save(obj)`` writes: its tensors' storages, each once (the distributed
    optimizer's parameters are views of one buffer; torch.save writes it once too)."""
    storages: dict[int, int] = {}

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return sum(storages.values())


def write_shard(tmp_root: str, payload: dict) -> str:
    """This rank's ``model_optim_rng.pt`` under ``tmp_root``, written atomically; returns its path."""
    path = os.path.join(tmp_root, my_shard_name(), "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_bytes(path, lambda f: torch.save(payload, f), _nbytes(payload))
    fsync_dir(os.path.dirname(path))
    return path


def shard_payload(model, iteration: int, config: dict, **state) -> dict:
    """What every ``model_optim_rng.pt`` holds (the weights, the layout, the config as plain data),
    with ``state`` (optimizer, scheduler, RNG, ...) beside."""
    return {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        **_model_state(model),
        **state,
        "parallel_layout": parallel_layout(),
        "config": config,
    }


def _write_shards(state, model, optimizer, scheduler, tmp_root: str) -> None:
    # Every dp rank sends its optimizer shards to dp rank 0 (a collective), whatever any write does.
    param_state = optimizer.get_parameter_state_dp_zero() if uses_distributed_optimizer(optimizer) else None
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        payload = shard_payload(
            model,
            state.train_state.step,
            plain(state.cfg),
            optimizer=optimizer.state_dict(),
            opt_param_scheduler=scheduler.state_dict(),
            train_state=state.train_state.state_dict(),
            rng_state=rng_state(),
        )
        path = write_shard(tmp_root, payload)
        if param_state is not None:  # the distributed optimizer's shards, beside the model's
            optim_path = get_distributed_optimizer_checkpoint_name(path)
            atomic_write_bytes(optim_path, lambda f: torch.save(param_state, f), _nbytes(param_state))


def _commit(root: str, tmp_root: str, iteration: int) -> None:
    """Rank 0: rename the complete save into place; a failure puts back what was there."""
    replace_directory(tmp_root, os.path.join(root, f"iter_{iteration:07d}"))


def _save_error(flag: str, root: str, iteration: int, err: Exception) -> str:
    reason = (
        write_error_line(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}".splitlines()[0]
    )
    return f"{flag} {root}: iteration {iteration} not saved, {reason}; the previous checkpoint and {TRACKER} are untouched"


def write_checkpoint(root: str, iteration: int, write_shards, flag: str = "--save") -> None:
    """Iteration ``iteration`` of ``root``, atomically: ``write_shards(tmp_root)`` (called on every rank,
    may run collectives) writes each rank's files into a temporary directory, rank 0 adds metadata.json,
    renames it into place and replaces the tracker last. Collective over the world; a write that fails
    on any rank (a full disk, a quota, an I/O error) is one CheckpointError on every rank, with the
    partial save removed and the previous checkpoint and tracker untouched."""
    tmp_root = os.path.join(root, f".tmp_iter_{iteration:07d}")
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            for name in os.listdir(root):  # leftovers of saves that were killed part-way
                if name.startswith(".tmp_iter_") or name.endswith(".old"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.makedirs(tmp_root)
        except OSError as err:
            error = _save_error(flag, root, iteration, err)
    agree(error)
    try:
        write_shards(tmp_root)
        if dist.get_rank() == 0:
            metadata = json.dumps(
                {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION, **parallel_layout()}
            )
            atomic_write_bytes(os.path.join(tmp_root, METADATA), lambda f: f.write(metadata.encode()))
    except Exception as err:  # a full disk, or anything else: the other ranks must hear of it, not wait
        error = _save_error(flag, root, iteration, err)
    if _TEST_DELAY_BEFORE_COMMIT_S:
        time.sleep(_TEST_DELAY_BEFORE_COMMIT_S)
    agree(error, cleanup=tmp_root)
    if dist.get_rank() == 0:
        try:
            _commit(root, tmp_root, iteration)
        except OSError as err:
            shutil.rmtree(tmp_root, ignore_errors=True)
            error = _save_error(flag, root, iteration, err)
        else:
            try:
                atomic_write_bytes(os.path.join(root, TRACKER), lambda f: f.write(f"{iteration}\n".encode()))
            except OSError as err:
                error = (
                    f"{flag} {root}: iteration {iteration} is on disk but {TRACKER} was not updated, "
                    f"{write_error_line(err)}; it still names the previous checkpoint"
                )
    agree(error)


def save_checkpoint(state, model, optimizer, scheduler, pg_collection) -> None:
    """Write this iteration's checkpoint (``write_checkpoint``). Collective over the world."""
    root, iteration = state.cfg.checkpoint.save, state.train_state.step
    write_checkpoint(
        root, iteration, lambda tmp_root: _write_shards(state, model, optimizer, scheduler, tmp_root)
    )
    if dist.get_rank() == 0:
        print(f" successfully saved checkpoint from iteration {iteration:7d} to {root}", flush=True)
