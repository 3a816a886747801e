"""Megatron-layout checkpoints, written atomically and loaded with every rank agreeing.

Layout: ``DIR/iter_0000010/mp_rank_XX[_YYY]/model_optim_rng.pt`` per (tensor, pipeline) rank, written
by the rank that is 0 in its data x context parallel group (``_YYY`` only with pipeline parallelism,
as Megatron names them), ``iter_*/metadata.json`` with the parallel layout, and
``DIR/latest_checkpointed_iteration.txt``. A save goes into a temporary directory that is renamed into
place once every shard is on disk; the tracker is replaced last. A crash mid-save leaves the previous
checkpoint and tracker untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron_lite.training.checkpoint_compat import checkpoint_model_error
from megatron_lite.training.distrib_optim_checkpointing import (
    get_distributed_optimizer_checkpoint_name,
    load_distributed_optimizer,
    optimizer_format_error,
    uses_distributed_optimizer,
)
from megatron_lite.training.utils.atomic_io import atomic_write_bytes, fsync_dir

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
CHECKPOINT_VERSION = 3.0
# Fault-injection tests widen the window between writing the shards and committing them.
_TEST_DELAY_BEFORE_COMMIT_S = float(os.environ.get("MEGATRON_LITE_TEST_SAVE_DELAY_S", "0"))


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; ``str(err)`` is the one line shown to the user."""


def _shard_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def get_checkpoint_name(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return os.path.join(
        root, f"iter_{iteration:07d}", _shard_name(tp_rank, pp_rank, pp_size), "model_optim_rng.pt"
    )


def _my_shard_name() -> str:
    return _shard_name(
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def _layout() -> dict[str, int]:
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
    }


def _rng_state() -> dict:
    state = {
        "random": random.getstate(),
        "torch": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    torch.set_rng_state(state["torch"])
    if "rng_tracker_states" in state:
        get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _chunks(model) -> list:
    return model if isinstance(model, list) else [model]


def _model_state(model) -> dict:
    """Upstream's keys: ``model`` for one chunk, ``model0``, ``model1``, ... for virtual stages."""
    chunks = _chunks(model)
    if len(chunks) == 1:
        return {"model": chunks[0].state_dict()}
    return {f"model{i}": chunk.state_dict() for i, chunk in enumerate(chunks)}


def _load_model_state(model, payload: dict) -> None:
    chunks = _chunks(model)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    missing = [k for k in keys if k not in payload]
    if missing:
        saved = sorted(k for k in payload if k.startswith("model"))
        raise ValueError(
            f"it holds {', '.join(saved)} but this run's {len(chunks)} model chunk(s) need {', '.join(keys)}"
        )
    for key, chunk in zip(keys, chunks):
        chunk.load_state_dict(payload[key])


def save_checkpoint(state, model, optimizer, scheduler, pg_collection) -> None:
    """Write this iteration's checkpoint. Collective over the world (barriers around the rename)."""
    root, iteration = state.cfg.checkpoint.save, state.train_state.step
    final_dir = os.path.join(root, f"iter_{iteration:07d}")
    tmp_root = os.path.join(root, f".tmp_iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of saves that were killed part-way
            if name.startswith(".tmp_iter_") or name.endswith(".old"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp_root)
    dist.barrier()
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        path = os.path.join(tmp_root, _my_shard_name(), "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        payload = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            **_model_state(model),
            "optimizer": optimizer.state_dict(),
            "opt_param_scheduler": scheduler.state_dict(),
            "train_state": state.train_state.state_dict(),
            "rng_state": _rng_state(),
            "parallel_layout": _layout(),
            "config": dataclasses.asdict(state.cfg),
        }
        atomic_write_bytes(path, lambda f: torch.save(payload, f))
        fsync_dir(os.path.dirname(path))
    if uses_distributed_optimizer(optimizer):
        # Every dp rank sends its shards; dp rank 0 writes them next to the model shard.
        param_state = optimizer.get_parameter_state_dp_zero()
        if param_state is not None:
            path = os.path.join(tmp_root, _my_shard_name(), "model_optim_rng.pt")
            optim_path = get_distributed_optimizer_checkpoint_name(path)
            atomic_write_bytes(optim_path, lambda f: torch.save(param_state, f))
    if dist.get_rank() == 0:
        metadata = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION, **_layout()}
        atomic_write_bytes(os.path.join(tmp_root, METADATA), lambda f: f.write(json.dumps(metadata).encode()))
    dist.barrier()
    if _TEST_DELAY_BEFORE_COMMIT_S:
        time.sleep(_TEST_DELAY_BEFORE_COMMIT_S)
    if dist.get_rank() == 0:
        fsync_dir(tmp_root)
        if os.path.exists(final_dir):  # re-saving an iteration: keep the old one until the new is in place
            stale = final_dir + ".old"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final_dir, stale)
            os.replace(tmp_root, final_dir)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(tmp_root, final_dir)
        fsync_dir(root)
        atomic_write_bytes(os.path.join(root, TRACKER), lambda f: f.write(f"{iteration}\n".encode()))
        print(f" successfully saved checkpoint from iteration {iteration:7d} to {root}", flush=True)
    dist.barrier()


def read_tracker(root: str) -> int | None:
    """The latest iteration in ``root``; None when there is nothing to resume from."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isdir(root) or not os.listdir(root):
        return None
    if not os.path.exists(tracker):
        if any(name.startswith("iter_") for name in os.listdir(root)):
            raise CheckpointError(
                f"--load {root}: has checkpoint directories but no {TRACKER}; "
                "point --load at a complete checkpoint directory"
            )
        return None
    try:
        with open(tracker) as f:
            text = f.read().strip()
        iteration = int(text)
    except (OSError, ValueError, UnicodeDecodeError):
        raise CheckpointError(f"--load {root}: {TRACKER} is unreadable or not an iteration number") from None
    if iteration < 0:
        raise CheckpointError(f"--load {root}: {TRACKER} holds a negative iteration ({iteration})")
    return iteration


def _layout_error(root: str, saved: dict, current: dict) -> str:
    return (
        f"--load {root}: saved with tp={saved.get('tensor_model_parallel_size')}, "
        f"pp={saved.get('pipeline_model_parallel_size')} but this run uses "
        f"tp={current['tensor_model_parallel_size']}, pp={current['pipeline_model_parallel_size']}; "
        "resume with the saved layout"
    )


def _layout_differs(saved: dict, current: dict) -> bool:
    return any(
        saved.get(k) != current[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    )


def _check_layout(root: str, iteration: int) -> None:
    """Refuse a checkpoint of another (tp, pp) layout before looking for this rank's shard."""
    path = os.path.join(root, f"iter_{iteration:07d}", METADATA)
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"--load {root}: iteration {iteration} is incomplete (no {METADATA})") from None
    except (OSError, ValueError):
        raise CheckpointError(f"--load {root}: iteration {iteration} has an unreadable {METADATA}") from None
    if not isinstance(saved, dict) or _layout_differs(saved, _layout()):
        raise CheckpointError(_layout_error(root, saved if isinstance(saved, dict) else {}, _layout()))


def _load_shard(root: str, iteration: int) -> dict:
    path = get_checkpoint_name(
        root,
        iteration,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    shard = os.path.relpath(path, root)
    if not os.path.exists(path):
        raise CheckpointError(
            f"--load {root}: iteration {iteration} has no shard {shard}; the checkpoint is incomplete"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for truncated or garbage files
        raise CheckpointError(
            f"--load {root}: cannot read {shard} ({type(err).__name__}); the file is corrupt or truncated"
        ) from None
    if not isinstance(payload, dict) or not any(k == "model" or k.startswith("model0") for k in payload):
        raise CheckpointError(f"--load {root}: {shard} is not a megatron_lite checkpoint")
    if _layout_differs(payload.get("parallel_layout", {}), _layout()):
        raise CheckpointError(_layout_error(root, payload.get("parallel_layout", {}), _layout()))
    return payload


def _my_optimizer_shard(root: str, iteration: int) -> str:
    return get_distributed_optimizer_checkpoint_name(
        get_checkpoint_name(
            root,
            iteration,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
    )


def _agree(error: str | None) -> None:
    """Raise the same CheckpointError on every rank if any rank failed. Collective over the world."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def load_checkpoint(state, model, optimizer, scheduler, pg_collection) -> int:
    """Restore from ``--load``; returns the loaded iteration (0 when starting fresh). Collective."""
    cfg = state.cfg.checkpoint
    payload, error, iteration = None, None, None
    try:
        iteration = read_tracker(cfg.load)
        if iteration is not None:
            _check_layout(cfg.load, iteration)
            payload = _load_shard(cfg.load, iteration)
            error = checkpoint_model_error(cfg.load, payload.get("config"), state.cfg.model)
            if error is None and cfg.load_optim and not cfg.finetune:
                error = optimizer_format_error(
                    cfg.load, iteration, payload, optimizer, _my_optimizer_shard(cfg.load, iteration)
                )
    except CheckpointError as err:
        error = str(err)
    _agree(error)
    if iteration is None:
        if dist.get_rank() == 0:
            print(f" no checkpoint found in {cfg.load}; starting from scratch", flush=True)
        return 0
    try:
        _load_model_state(model, payload)
        if not cfg.finetune:
            state.train_state.load_state_dict(payload["train_state"])
            if cfg.load_optim:
                optimizer.load_state_dict(payload["optimizer"])
                if uses_distributed_optimizer(optimizer):
                    error = load_distributed_optimizer(
                        cfg.load, _my_optimizer_shard(cfg.load, iteration), optimizer
                    )
                scheduler.load_state_dict(payload["opt_param_scheduler"])
            if cfg.load_rng:
                _set_rng_state(payload["rng_state"])
    # AttributeError / TypeError: a train_state field that is no tensor (another format's checkpoint).
    except (KeyError, RuntimeError, ValueError, TypeError, AttributeError) as err:
        error = (
            f"--load {cfg.load}: iteration {iteration} does not match this model ({str(err).splitlines()[0]})"
        )
    _agree(error)
    if cfg.finetune:
        # Fresh optimizer at full learning rate: the schedule restarts with the iteration count.
        scheduler.step(0)
    if dist.get_rank() == 0:
        print(f" successfully loaded checkpoint from {cfg.load} at iteration {iteration}", flush=True)
    return iteration
