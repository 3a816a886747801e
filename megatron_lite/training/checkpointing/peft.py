"""PEFT checkpoints (Megatron-Bridge's): a run with ``config.peft`` saves its adapters only, with their
optimizer state, the schedule, the RNG and the iteration, in either format; its frozen base comes from
``--pretrained-checkpoint`` again on resume (``pretrained``), then the adapters from ``--load``.

Such a checkpoint names its base: ``peft_base`` (beside ``config``, in every ``torch`` shard and in a
``torch_dist`` checkpoint's ``common.pt``) holds the base checkpoint's path, the architecture its
adapters were trained on (every field that fixes the base's shapes) and a fingerprint of it. A resume
onto another base, a PEFT checkpoint resumed without ``--peft`` or a full checkpoint resumed with it
is refused in one line before the base is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch

from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.compat import architecture_difference, architecture_record
from megatron_lite.training.checkpointing.layout import model_chunks, model_keys, read_tracker
from megatron_lite.training.checkpointing.reshard import read_saved_payload
from megatron_lite.training.checkpointing.safety import CheckpointError, plain

PEFT_BASE = "peft_base"

# LoRA's fields that change what the saved adapters are (their shapes, or what they compute).
_ADAPTER_FIELDS = (
    ("dim", "--lora-dim"),
    ("alpha", "--lora-alpha"),
    ("target_modules", "--lora-target-modules"),
    ("exclude_modules", "--lora-exclude-modules"),
)


def fingerprint(architecture: dict) -> str:
    """A short digest of an ``architecture_record``: equal for bases whose weights have the same shapes."""
    text = json.dumps(architecture, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def base_record(cfg) -> dict:
    """What a PEFT checkpoint records of its base (``cfg``: the run's ConfigContainer)."""
    architecture = architecture_record(cfg.model)
    base = cfg.checkpoint.pretrained_checkpoint
    return {
        # Absolute: an export or a resume may run from another directory.
        "pretrained_checkpoint": None if base is None else os.path.abspath(base),
        "architecture": architecture,
        "fingerprint": fingerprint(architecture),
    }


def peft_entries(cfg) -> dict:
    """What a PEFT run's checkpoint holds beside its config (``{PEFT_BASE: base_record}``); {} otherwise."""
    return {} if cfg.peft is None else {PEFT_BASE: base_record(cfg)}


def checkpoint_config(cfg) -> dict:
    """The run's config as a checkpoint records it (``plain``), its ``peft`` section as the PEFT
    method's settings only (its fields a constructor takes, not its matching state)."""
    config = plain(cfg)
    if cfg.peft is not None:
        config["peft"] = {
            f.name: plain(getattr(cfg.peft, f.name))
            for f in dataclasses.fields(cfg.peft)
            if f.init and not f.name.startswith("_")
        }
    return config


def keeps(cfg):
    """The state-dict key filter of this run's checkpoints: the PEFT method's ``adapter_key_filter``
    (adapters only), or None (every key)."""
    return None if cfg.peft is None else cfg.peft.adapter_key_filter


def adapter_state(model, keep) -> dict:
    """``{model / model<i>: state dict}`` of the model chunks with only the keys ``keep`` admits."""
    chunks = model_chunks(model)
    return {
        key: {k: v for k, v in chunk.state_dict().items() if keep(k)}
        for key, chunk in zip(model_keys(len(chunks)), chunks)
    }


def saved_parameters(cfg, model) -> set | None:
    """The parameters a ``torch_dist`` checkpoint of this run holds (with their optimizer state): a
    PEFT run's trainable ones (the adapters), else all (None)."""
    if cfg.peft is None:
        return None
    return {p for chunk in model_chunks(model) for p in chunk.parameters() if p.requires_grad}


@torch.no_grad()
def load_adapter_state(model, payload: dict, keep) -> None:
    """The payload's adapter entries into the model chunks, each in place; ValueError naming the first
    entry missing on either side or of another shape (the base keys are not the checkpoint's)."""
    chunks = model_chunks(model)
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        if key not in payload:
            raise ValueError(f"it holds no {key}")
        mine = {k: v for k, v in chunk.state_dict(keep_vars=True).items() if keep(k)}
        saved = payload[key]
        missing = sorted(set(mine) - set(saved)) or sorted(set(saved) - set(mine))
        if missing:
            where = "the checkpoint lacks" if missing[0] in mine else "this model has no"
            raise ValueError(f"{where} {missing[0]}")
        for name, tensor in mine.items():
            if tensor.shape != saved[name].shape:
                raise ValueError(
                    f"{name} is {tuple(saved[name].shape)} in the checkpoint, {tuple(tensor.shape)} here"
                )
            tensor.copy_(saved[name])


def _saved_iteration(ck) -> int | None:
    if ck.load is None:
        return None
    return ck.ckpt_step if ck.ckpt_step is not None else read_tracker(ck.load)


def _adapter_difference(saved_peft: dict, peft) -> str | None:
    for name, flag in _ADAPTER_FIELDS:
        before, now = saved_peft.get(name), getattr(peft, name, None)
        if isinstance(now, tuple):
            now = list(now)
        if before != now:
            return f"its adapters have {name}={before!r} but {flag} gives {name}={now!r}; use the saved LoRA flags"
    return None


def resume_error(cfg) -> str | None:
    """Why ``--load``'s checkpoint cannot resume this run as PEFT or full training, or None (also when
    it holds none). Reads its recorded config only; a CheckpointError for a checkpoint it cannot read."""
    ck = cfg.checkpoint
    iteration = _saved_iteration(ck)
    if iteration is None:
        return None
    saved = read_saved_payload(ck.load, iteration)
    record, where = saved.get(PEFT_BASE), f"--load {ck.load}: iteration {iteration}"
    if cfg.peft is None:
        if record is None:
            return None
        return (
            f"{where} holds LoRA adapters only (a PEFT checkpoint of the base "
            f"{record.get('pretrained_checkpoint')}); resume it with --peft lora --pretrained-checkpoint "
            f"{record.get('pretrained_checkpoint')}"
        )
    if record is None:
        return (
            f"{where} is a full model checkpoint, not LoRA adapters; fine-tune from it with "
            f"--pretrained-checkpoint {ck.load} and a --load that holds no checkpoint yet"
        )
    now = architecture_record(cfg.model)
    if record.get("fingerprint") != fingerprint(now):
        name, flag, before, after = architecture_difference(record.get("architecture", {}), now) or (
            "fingerprint",
            "the model flags",
            record.get("fingerprint"),
            fingerprint(now),
        )
        return (
            f"{where} holds adapters for another base ({record.get('pretrained_checkpoint')}, with "
            f"{name}={before!r}) than this run's model ({name}={after!r}, from {flag}); resume on the base "
            "it was trained on, with its architecture flags (or --use-checkpoint-args)"
        )
    difference = _adapter_difference(saved.get("config", {}).get("peft") or {}, cfg.peft)
    return difference and f"{where}: {difference}"


def peft_layout_error(root: str, iteration: int, saved: dict, now: dict) -> str:
    """A legacy-format PEFT checkpoint at another layout: its adapters are not resharded."""
    return (
        f"--load {root}: iteration {iteration} holds adapters saved with tp={saved.get('tensor_model_parallel_size')}, "
        f"pp={saved.get('pipeline_model_parallel_size')}; --ckpt-format torch resumes them at that layout only "
        f"(this run: tp={now['tensor_model_parallel_size']}, pp={now['pipeline_model_parallel_size']}); save "
        "with --ckpt-format torch_dist to change it"
    )


def check_resume(cfg) -> None:
    """``resume_error`` as one CheckpointError on every rank, before the base is read. Collective over
    the world."""
    try:
        error = resume_error(cfg)
    except Exception as err:
        # A full run's load reads the checkpoint again and says what is wrong with it, as it always did.
        error = None
        if cfg.peft is not None and isinstance(err, CheckpointError):
            error = str(err)
        elif cfg.peft is not None:  # a payload of an unexpected shape: one line
            error = (
                f"--load {cfg.checkpoint.load}: cannot be read ({type(err).__name__}: {err})".splitlines()[0]
            )
    agree(error)


def is_peft_checkpoint(saved: dict) -> bool:
    """Whether a saved payload (``read_saved_payload``'s) holds adapters only."""
    return saved.get(PEFT_BASE) is not None
