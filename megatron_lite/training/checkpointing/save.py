"""Saving: every shard into a temporary directory, renamed into place once all are on disk, the
tracker replaced last. A crash or a failed write mid-save leaves the previous checkpoint and tracker
untouched."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.training.checkpointing.commit import write_checkpoint
from megatron_lite.training.checkpointing.distrib_optim import (
    get_distributed_optimizer_checkpoint_name,
    uses_distributed_optimizer,
)
from megatron_lite.training.checkpointing.layout import (
    CHECKPOINT_VERSION,
    model_chunks,
    model_keys,
    my_shard_name,
    parallel_layout,
)
from megatron_lite.training.checkpointing.peft import adapter_state, checkpoint_config, keeps, peft_entries
from megatron_lite.training.checkpointing.rng import rng_state
from megatron_lite.training.checkpointing.torch_dist import save_distributed
from megatron_lite.utils.atomic_io import atomic_write_bytes, fsync_dir


def _model_state(model, keep=None) -> dict:
    """Each chunk's state dict; with ``keep`` (a PEFT run's adapter filter) only the keys it admits."""
    if keep is not None:
        return adapter_state(model, keep)
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


def shard_payload(model, iteration: int, config: dict, keep=None, **state) -> dict:
    """What every ``model_optim_rng.pt`` holds (the weights, the layout, the config as plain data),
    with ``state`` (optimizer, scheduler, RNG, ...) beside; ``keep``: see ``_model_state``."""
    return {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        **_model_state(model, keep),
        **state,
        "parallel_layout": parallel_layout(),
        "config": config,
    }


def _expert_layout_error() -> str | None:
    """The legacy files are named by tensor rank: an expert tensor-parallel size other than 1 or the
    dense one would put different expert slices under one name."""
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if etp in (1, parallel_state.get_tensor_model_parallel_world_size()):
        return None
    return (
        f"--expert-tensor-parallel-size {etp}: --ckpt-format torch names its files by tensor rank and needs "
        "an expert tensor-parallel size of 1 or --tensor-model-parallel-size; use --ckpt-format torch_dist"
    )


def is_shard_writer(model_cfg) -> bool:
    """Whether this rank writes its (tp, pp[, ep]) shard: dp rank 0 for a dense model; for a MoE model
    the lowest rank holding that shard (upstream writes from dp rank 0 or expert-dp rank 0, which
    together cover every shard; one writer each keeps two from racing). Collective for a MoE model."""
    if not model_cfg.num_moe_experts:
        return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, my_shard_name())
    return names.index(my_shard_name()) == dist.get_rank()


def _write_shards(state, model, optimizer, scheduler, tmp_root: str) -> None:
    error = _expert_layout_error()
    if error:
        raise ValueError(error)
    writer = is_shard_writer(state.cfg.model)
    # Every dp rank sends its optimizer shards to dp rank 0 (a collective), whatever any write does.
    param_state = optimizer.get_parameter_state_dp_zero() if uses_distributed_optimizer(optimizer) else None
    if writer:
        payload = shard_payload(
            model,
            state.train_state.step,
            checkpoint_config(state.cfg),
            keeps(state.cfg),  # a PEFT run's adapters only, naming their base (peft.py)
            **peft_entries(state.cfg),
            optimizer=optimizer.state_dict(),
            opt_param_scheduler=scheduler.state_dict(),
            train_state=state.train_state.state_dict(),
            rng_state=rng_state(),
        )
        path = write_shard(tmp_root, payload)
        if param_state is not None:  # the distributed optimizer's shards, beside the model's
            optim_path = get_distributed_optimizer_checkpoint_name(path)
            atomic_write_bytes(optim_path, lambda f: torch.save(param_state, f), _nbytes(param_state))


def save_checkpoint(state, model, optimizer, scheduler, pg_collection) -> None:
    """Write this iteration's checkpoint in ``--ckpt-format`` (``torch``: ``write_checkpoint`` here;
    ``torch_dist``: ``torch_dist.save_distributed``, in the background with ``--async-save``).
    Collective over the world."""
    root, iteration = state.cfg.checkpoint.save, state.train_state.step
    if state.cfg.checkpoint.ckpt_format == "torch_dist":
        save_distributed(state, model, optimizer, scheduler)
        return
    write_checkpoint(
        root, iteration, lambda tmp_root: _write_shards(state, model, optimizer, scheduler, tmp_root)
    )
    if dist.get_rank() == 0:
        print(f" successfully saved checkpoint from iteration {iteration:7d} to {root}", flush=True)
