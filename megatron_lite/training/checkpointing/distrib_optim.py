"""The distributed optimizer's part of a checkpoint: upstream's legacy ``distrib_optim.pt``.

One file per (tensor, pipeline) shard, beside its ``model_optim_rng.pt``, written by data-parallel
rank 0 after gathering every rank's optimizer shards (DistributedOptimizer.get_parameter_state_dp_zero)
inside the save's temporary directory, so the commit that makes the model shards visible makes it
visible too. Checks return one error line (or None) for checkpointing's agreed refusal.
"""

from __future__ import annotations

import os

from megatron_lite.training.checkpointing.safety import CheckpointError, load_checkpoint_file


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name: str) -> str:
    """Upstream's legacy name: ``distrib_optim.pt`` beside the shard's ``model_optim_rng.pt``."""
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def uses_distributed_optimizer(optimizer) -> bool:
    return hasattr(optimizer, "get_parameter_state_dp_zero")


def optimizer_format_error(root: str, iteration: int, payload: dict, optimizer, path: str) -> str | None:
    """One line when the checkpoint's optimizer (``payload``'s, with its shard at ``path``) cannot
    restore this run's; checked before anything loads."""
    saved_sharded = bool((payload.get("optimizer") or {}).get("use_distributed_optimizer", False))
    if saved_sharded != uses_distributed_optimizer(optimizer):
        saved, now = ("with", "without") if saved_sharded else ("without", "with")
        return (
            f"--load {root}: iteration {iteration} was saved {saved} --use-distributed-optimizer but this "
            f"run is {now} it; use the saved setting or --no-load-optim"
        )
    if saved_sharded and not os.path.exists(path):
        return (
            f"--load {root}: iteration {iteration} has no optimizer shard {os.path.relpath(path, root)}; "
            "the checkpoint is incomplete"
        )
    return None


def read_distributed_optimizer(root: str, path: str, optimizer) -> dict:
    """This shard's optimizer state from ``path``, checked against this model before anything loads;
    CheckpointError otherwise. Reads a file only (never with the older-layout allowlist: this file
    only ever held tensors and numbers)."""
    shard = os.path.relpath(path, root)
    param_state = load_checkpoint_file(path, root, legacy=False)
    if not isinstance(param_state, dict):
        raise CheckpointError(f"--load {root}: {shard} is not a distributed optimizer shard")
    saved = [sum(b) for b in param_state.get("per_bucket_numel_unpadded", [])]
    now = [sum(b) for b in optimizer.per_bucket_numel_unpadded()]
    if saved != now:
        raise CheckpointError(f"--load {root}: {shard} holds {saved} parameters but this model has {now}")
    return param_state
