"""A PEFT checkpoint (LoRA adapters only, naming their base) out to Hugging Face, on the ranks of a
running world at the checkpoint's layout (what ``tools/checkpoint_conversion.py export`` starts): the
base weights from the checkpoint it names (a megatron_lite checkpoint of either format and any layout,
or a Hugging Face directory), LoRA applied as the run had it, the adapters from the checkpoint, then
either the merged model (``LoRAMerge`` folds the adapters into the base weights; the plain export
follows) or, ``adapter_only``, a Hugging Face PEFT adapter directory (``save_hf_adapter``)."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.conversion.megatron_checkpoints import (
    export_chunks,
    rank_shard_name,
    save_whole,
    saved_layout,
)
from megatron_lite.peft import LoRA
from megatron_lite.peft.lora_merge import merge_lora_model
from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.hf_directory import is_hf_directory
from megatron_lite.training.checkpointing.layout import (
    is_distributed_checkpoint,
    read_shard,
    read_tracker,
)
from megatron_lite.training.checkpointing.peft import PEFT_BASE, load_adapter_state
from megatron_lite.training.checkpointing.pretrained import load_pretrained_weights
from megatron_lite.training.checkpointing.reshard import read_saved_payload
from megatron_lite.training.checkpointing.safety import CheckpointError
from megatron_lite.training.checkpointing.torch_dist import load_distributed_weights

FLAG = "--megatron-path"


def _saved(megatron_path: str) -> tuple[int, dict]:
    """(latest iteration, what it records: config, ``peft_base``)."""
    iteration, _ = saved_layout(megatron_path)
    try:
        return iteration, read_saved_payload(megatron_path, iteration)
    except CheckpointError as err:
        raise BridgeError(str(err).replace("--load", FLAG)) from None


def peft_checkpoint(megatron_path: str) -> tuple[dict, dict] | None:
    """(its base record, its LoRA config) when the latest iteration of ``megatron_path`` holds
    adapters only; None for a full checkpoint."""
    saved = _saved(megatron_path)[1]
    if saved.get(PEFT_BASE) is None:
        return None
    return saved[PEFT_BASE], (saved.get("config") or {}).get("peft") or {}


def base_of(megatron_path: str, record: dict, base_checkpoint: str | None) -> str:
    """The base to export with: ``--base-checkpoint``, else the one the PEFT checkpoint names; one
    BridgeError line when it holds no weights."""
    base = base_checkpoint or record.get("pretrained_checkpoint")
    if not base:
        raise BridgeError(
            f"{FLAG} {megatron_path}: the PEFT checkpoint names no base; give it as --base-checkpoint"
        )
    try:
        holds = is_hf_directory(base) or (
            os.path.isdir(base) and read_tracker(base, flag="--base-checkpoint") is not None
        )
    except CheckpointError as err:
        raise BridgeError(str(err)) from None
    what = "a megatron_lite checkpoint nor a Hugging Face model (config.json + *.safetensors)"
    if not holds and base_checkpoint:
        raise BridgeError(f"--base-checkpoint {base}: holds neither {what}")
    if not holds:
        raise BridgeError(
            f"{FLAG} {megatron_path} names the base {base}, which holds neither {what}; "
            "give the base as --base-checkpoint"
        )
    return base


def lora_from_record(values: dict) -> LoRA:
    """The run's LoRA from its recorded config (the dataclass's own fields)."""
    names = {f.name for f in dataclasses.fields(LoRA) if f.init}
    return LoRA(**{k: v for k, v in values.items() if k in names})


def _load_adapters(chunks, provider, megatron_path: str, iteration: int, lora) -> None:
    """The adapters of this rank's part of the checkpoint into the LoRA-wrapped chunks. Collective:
    every rank hears of any rank's error (one BridgeError line)."""
    if is_distributed_checkpoint(megatron_path, iteration, flag=FLAG):
        adapters = {p for chunk in chunks for p in chunk.parameters() if p.requires_grad}
        try:
            load_distributed_weights(chunks, provider, megatron_path, iteration, flag=FLAG, only=adapters)
        except CheckpointError as err:
            raise BridgeError(str(err)) from None
        return
    shard = rank_shard_name(megatron_path, iteration)
    error = None
    try:
        load_adapter_state(chunks, read_shard(shard, megatron_path, flag=FLAG), lora.adapter_key_filter)
    except FileNotFoundError:
        error = f"{FLAG} {megatron_path}: iteration {iteration} has no {shard}"
    except CheckpointError as err:
        error = str(err)
    except ValueError as err:
        error = f"{FLAG} {megatron_path}: {shard} does not fit the model ({err})"
    try:
        agree(error)
    except CheckpointError as err:
        raise BridgeError(str(err)) from None


def export_peft_ckpt(
    bridge, megatron_path: str, hf_path: str, *, adapter_only: bool, base_checkpoint=None, show_progress=False
) -> None:
    """Load the base and the adapters at this world's layout (the checkpoint's) and write ``hf_path``:
    the merged model, or with ``adapter_only`` the PEFT adapter directory. Collective."""
    iteration, saved = _saved(megatron_path)
    base = base_of(megatron_path, saved[PEFT_BASE], base_checkpoint)
    chunks, provider = export_chunks(bridge, megatron_path, saved.get("config"))
    state = SimpleNamespace(
        cfg=SimpleNamespace(checkpoint=SimpleNamespace(pretrained_checkpoint=base), model=provider)
    )
    try:
        load_pretrained_weights(state, chunks)  # collective: every rank hears of any rank's error
    except CheckpointError as err:
        raise BridgeError(str(err).replace("--pretrained-checkpoint", "base")) from None
    lora = lora_from_record(saved["config"].get("peft") or {})
    chunks = lora(chunks, training=True)  # adapters trainable: what the checkpoint holds
    _load_adapters(chunks, provider, megatron_path, iteration, lora)
    if adapter_only:
        name = base if is_hf_directory(base) else str(getattr(bridge.hf_pretrained, "model_name_or_path", ""))
        bridge.save_hf_adapter(
            chunks, hf_path, lora, base_model_name_or_path=name, show_progress=show_progress
        )
        return
    save_whole(bridge, merge_lora_model(chunks), hf_path, show_progress)
