"""Loading: every rank checks its shard (layout, architecture, optimizer format) and all agree before
any state changes; files are read with torch's weights-only unpickler (safety.py)."""

from __future__ import annotations

import os

import torch.distributed as dist

from megatron_lite.training.checkpointing import megatron_lm
from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.compat import (
    checkpoint_model_error,
    resharded_model_error,
    saved_split,
)
from megatron_lite.training.checkpointing.distrib_optim import (
    optimizer_format_error,
    read_distributed_optimizer,
    uses_distributed_optimizer,
)
from megatron_lite.training.checkpointing.hf_directory import (  # HF directory
    finetune_from_hf_directory,
    pretrained_hf_directory,
)
from megatron_lite.training.checkpointing.layout import (
    TRACKER,
    check_layout,
    expert_layout_differs,
    is_distributed_checkpoint,
    layout_differs,
    layout_error,
    model_chunks,
    model_keys,
    my_checkpoint_name,
    my_optimizer_shard,
    parallel_layout,
    read_metadata,
    read_shard,
    read_tracker,
)
from megatron_lite.training.checkpointing.megatron_lm_optimizer import apply_by_name
from megatron_lite.training.checkpointing.peft import keeps, load_adapter_state, peft_layout_error
from megatron_lite.training.checkpointing.reshard import (
    describe_layout,
    read_saved_config,
    resharded_state,
    split_differs,
)
from megatron_lite.training.checkpointing.rng import set_rng_state
from megatron_lite.training.checkpointing.safety import CheckpointError
from megatron_lite.training.checkpointing.torch_dist import MEGATRON_LM_RNG, load_distributed, reseed


def load_model_state(model, payload: dict) -> None:
    """The payload's ``model`` / ``model<i>`` state dicts into the model chunks (ValueError naming the
    missing ones, RuntimeError from ``load_state_dict`` for entries that do not fit)."""
    chunks = model_chunks(model)
    keys = model_keys(len(chunks))
    missing = [k for k in keys if k not in payload]
    if missing:
        saved = sorted(k for k in payload if k.startswith("model"))
        raise ValueError(
            f"it holds {', '.join(saved)} but this run's {len(chunks)} model chunk(s) need {', '.join(keys)}"
        )
    for key, chunk in zip(keys, chunks):
        chunk.load_state_dict(payload[key])


def _load_shard(root: str, iteration: int) -> dict:
    path = my_checkpoint_name(root, iteration)
    shard = os.path.relpath(path, root)
    if not os.path.exists(path):
        raise CheckpointError(
            f"--load {root}: iteration {iteration} has no shard {shard}; the checkpoint is incomplete"
        )
    payload = read_shard(path, root)
    if not isinstance(payload, dict) or not any(k == "model" or k.startswith("model0") for k in payload):
        raise CheckpointError(f"--load {root}: {shard} is not a megatron_lite checkpoint")
    if layout_differs(payload.get("parallel_layout", {}), parallel_layout()):
        raise CheckpointError(layout_error(root, payload.get("parallel_layout", {}), parallel_layout()))
    return payload


def read_weights(root: str, iteration: int, finetune: bool, model, model_cfg):
    """``(payload, error, note)``: this rank's payload, the first difference that refuses it, and the
    line announcing a reshard (None when the checkpoint's layout is this run's). A full resume reads
    its own shard of the saved layout only; a weights-only load takes the weights of any layout."""
    saved_layout = read_metadata(root, iteration)
    if finetune and layout_differs(saved_layout, parallel_layout()):
        if expert_layout_differs(saved_layout, parallel_layout()) or _is_moe(root, iteration):
            return None, _moe_reshard_error(root, saved_layout), None
        saved_config = read_saved_config(root, iteration)
    else:
        check_layout(root, iteration)
        payload = _load_shard(root, iteration)
        if not (finetune and split_differs(payload.get("config"), model_cfg)):
            return payload, checkpoint_model_error(root, payload.get("config"), model_cfg), None
        saved_config = payload.pop("config")
        del payload  # its tensors are read again stage by stage; keep one copy in memory at a time
    error = resharded_model_error(root, saved_config, model_cfg)
    if error:
        return None, error, None
    saved_tp = saved_config["model"].get("tensor_model_parallel_size", 1)
    note = (
        f" resharding checkpoint weights from {describe_layout(saved_tp, saved_split(saved_config))} "
        f"to {describe_layout(model_cfg.tensor_model_parallel_size, model_cfg)}"
    )
    return resharded_state(root, iteration, saved_config, model, model_cfg), None, note


def _megatron_lm_optimizer_error(root: str, payload: dict, optimizer) -> str | None:
    """Why this rank cannot resume a Megatron-LM ``torch``-format shard's optimizer state, or None."""
    reason = payload["megatron_lm"]["optimizer_error"]
    if reason is None and uses_distributed_optimizer(optimizer):
        reason = "into --use-distributed-optimizer, whose shards are not read from it yet"
    return megatron_lm.optimizer_error(f"--load {root}", reason)


def _is_moe(root: str, iteration: int) -> bool:
    return bool(read_saved_config(root, iteration).get("model", {}).get("num_moe_experts"))


def _moe_reshard_error(root: str, saved: dict) -> str:
    """A legacy MoE checkpoint at another layout: its files hold experts by local index per
    expert-parallel rank, which ``reshard`` does not remap."""
    if expert_layout_differs(saved, parallel_layout()):
        return layout_error(root, saved, parallel_layout())
    return (
        f"--load {root}: a mixture-of-experts checkpoint in --ckpt-format torch loads at its saved layout "
        f"only ({_describe_saved(saved)}); save with --ckpt-format torch_dist to change it"
    )


def _describe_saved(saved: dict) -> str:
    return f"tp={saved.get('tensor_model_parallel_size')}, pp={saved.get('pipeline_model_parallel_size')}"


def _chosen_iteration(root: str, step: int) -> int:
    """``--ckpt-step``: that iteration of ``root``, which must be there."""
    if not os.path.isdir(os.path.join(root, f"iter_{step:07d}")):
        present = sorted(n for n in os.listdir(root) if n.startswith("iter_")) if os.path.isdir(root) else []
        raise CheckpointError(
            f"--ckpt-step {step}: {root} has no iter_{step:07d}; it holds {', '.join(present) or 'none'}"
        )
    return step


def resolve_checkpoint(cfg, pretrained: bool = True) -> tuple[str | None, int | None, bool]:
    """Where to load from, which iteration (None: start fresh) and whether weights only, as upstream:
    ``load`` when it holds a checkpoint (its ``ckpt_step`` or latest), else ``pretrained_checkpoint``
    (its latest, weights only; not with ``pretrained`` False: a PEFT run read it before wrapping).
    ``--ckpt-step`` names an iteration of ``load`` only; a ``load`` with iterations but no tracker is
    refused, never passed over for the pretrained weights."""
    if cfg.ckpt_step is not None:
        return cfg.load, _chosen_iteration(cfg.load, cfg.ckpt_step), cfg.finetune
    iteration = None if cfg.load is None else read_tracker(cfg.load)
    if cfg.pretrained_checkpoint is None or iteration is not None or not pretrained:
        return cfg.load, iteration, cfg.finetune
    iteration = read_tracker(cfg.pretrained_checkpoint, flag="--pretrained-checkpoint")
    if iteration is None:
        resume = f", and --load {cfg.load} none to resume" if cfg.load else ""
        raise CheckpointError(
            f"--pretrained-checkpoint {cfg.pretrained_checkpoint}: holds no checkpoint "
            f"(no {TRACKER} naming an iteration){resume}"
        )
    return cfg.pretrained_checkpoint, iteration, True


def load_checkpoint(state, model, optimizer, scheduler, pg_collection) -> int:
    """Restore from ``--load`` (or ``--pretrained-checkpoint``); returns the loaded iteration (0 when
    starting fresh). Collective."""
    cfg = state.cfg.checkpoint
    keep = keeps(state.cfg)  # a PEFT run: its base came from --pretrained-checkpoint; adapters only here
    hf_dir = pretrained_hf_directory(cfg) if keep is None else None  # HF directory: through the bridge
    if hf_dir is not None:
        return finetune_from_hf_directory(state, model, optimizer, scheduler, hf_dir)
    root, payload, param_state, error, iteration, finetune = cfg.load, None, None, None, None, cfg.finetune
    distributed = False
    schedule_error, reshard_note = None, None
    # Every file is read and checked before any state changes; every rank hears of any rank's error.
    try:
        root, iteration, finetune = resolve_checkpoint(cfg, pretrained=keep is None)
        distributed = iteration is not None and is_distributed_checkpoint(root, iteration)
        if iteration is not None and not distributed and keep is not None:
            # A legacy PEFT checkpoint's adapters load at its saved layout only (no reshard of them).
            saved_layout = read_metadata(root, iteration)
            if layout_differs(saved_layout, parallel_layout()):
                raise CheckpointError(peft_layout_error(root, iteration, saved_layout, parallel_layout()))
        if iteration is not None and not distributed:
            payload, error, reshard_note = read_weights(
                root, iteration, finetune and keep is None, model, state.cfg.model
            )
            if error is None and cfg.load_optim and not finetune:
                optimizer_shard = my_optimizer_shard(root, iteration)
                error = (
                    _megatron_lm_optimizer_error(root, payload, optimizer)
                    if payload.get("megatron_lm")
                    else optimizer_format_error(root, iteration, payload, optimizer, optimizer_shard)
                )
                if error is None and uses_distributed_optimizer(optimizer):
                    param_state = read_distributed_optimizer(root, optimizer_shard, optimizer)
                saved_schedule = payload.get("opt_param_scheduler")
                if error is None and not isinstance(saved_schedule, dict):
                    error = (
                        f"--load {root}: iteration {iteration} holds no learning-rate schedule state; "
                        "--no-load-optim starts the optimizer and its schedule afresh"
                    )
                elif error is None:
                    mismatch = scheduler.checkpoint_mismatch(saved_schedule)
                    schedule_error = mismatch and f"--load {root}: iteration {iteration}: {mismatch}"
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # a config or payload of an unexpected shape: one line, on every rank
        error = f"--load {root}: iteration {iteration} cannot be read ({type(err).__name__}: {err})"
        error = error.splitlines()[0]
    agree(error)
    # One more exchange: each rank's choice of checkpoint (each read the tracker itself) must be the
    # same; then, every shard being there and fitting, the schedule check (the same on every rank).
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, ((root, iteration, finetune), schedule_error))
    choices = [choice for choice, _ in seen]
    if any(choice != choices[0] for choice in choices):
        raise CheckpointError(
            f"--load {cfg.load}: the ranks found different checkpoints ({sorted(set(map(str, choices)))}); "
            "every rank must see the same checkpoint directory"
        )
    schedule_error = next((e for _, e in seen if e), None)
    if schedule_error:
        raise CheckpointError(schedule_error)
    if finetune and root != cfg.load and dist.get_rank() == 0:
        print(
            f" no checkpoint found in load directory {cfg.load}; finetuning from the pretrained "
            f"checkpoint {root}",
            flush=True,
        )
    if iteration is None:
        if dist.get_rank() == 0 and keep is not None:
            print(f" no checkpoint found in {root}; training new adapters on the base model", flush=True)
        elif dist.get_rank() == 0:
            print(f" no checkpoint found in {root}; starting from scratch", flush=True)
        return 0
    if distributed:
        load_distributed(state, model, optimizer, scheduler, root, iteration, finetune)
        if dist.get_rank() == 0:
            print(f" successfully loaded checkpoint from {root} at iteration {iteration}", flush=True)
        return iteration
    if reshard_note and dist.get_rank() == 0:
        print(reshard_note, flush=True)
    try:
        if keep is not None:
            load_adapter_state(model, payload, keep)
        else:
            load_model_state(model, payload)
        if not finetune:
            state.train_state.load_state_dict(payload["train_state"])
            if cfg.load_optim and payload.get("megatron_lm"):
                optimizer.reload_model_params(None)  # fp32 main weights from the weights just loaded
                apply_by_name(optimizer, model_chunks(model), payload["megatron_lm"]["optimizer_by_name"])
                scheduler.load_state_dict(payload["opt_param_scheduler"])
            elif cfg.load_optim:
                optimizer.load_state_dict(payload["optimizer"])
                if param_state is not None:
                    # Offsets skip the bucket padding: any data-parallel size or bucketing takes its shard.
                    optimizer.load_parameter_state_from_dp_zero(param_state)
                elif "fp32_from_fp16_params" not in payload["optimizer"]:
                    # Saved by an fp32 run: its weights were its main weights, to the bit.
                    optimizer.reload_model_params(payload)
                scheduler.load_state_dict(payload["opt_param_scheduler"])
            if cfg.load_rng and payload["rng_state"] is None:  # Megatron-LM's: not carried
                reseed(MEGATRON_LM_RNG, state.cfg.rng.seed + iteration)
            elif cfg.load_rng:
                set_rng_state(payload["rng_state"])
        if finetune or not cfg.load_optim:
            # The fp32 main parameters were copied from the weights before these were loaded.
            optimizer.reload_model_params(payload if cfg.load_main_params_from_ckpt else None)
    # AttributeError / TypeError: a train_state field that is no tensor (another format's checkpoint).
    except (KeyError, RuntimeError, ValueError, TypeError, AttributeError) as err:
        error = f"--load {root}: iteration {iteration} does not match this model ({str(err).splitlines()[0]})"
    agree(error)
    if finetune:
        # Fresh optimizer at full learning rate: the schedule restarts with the iteration count.
        scheduler.step(0)
    if dist.get_rank() == 0:
        print(f" successfully loaded checkpoint from {root} at iteration {iteration}", flush=True)
    return iteration
