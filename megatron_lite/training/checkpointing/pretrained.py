"""The base weights of a PEFT run: ``--pretrained-checkpoint`` read into the model chunks before the
PEFT transform wraps them (Megatron-Bridge's pre-wrap hook), weights only, at any layout, in either
format (a legacy one at another layout through ``reshard``), or a Hugging Face directory through the
bridge (``hf_directory``'s registered loader).
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.compat import resharded_model_error
from megatron_lite.training.checkpointing.hf_directory import is_hf_directory, load_hf_directory
from megatron_lite.training.checkpointing.layout import (
    TRACKER,
    is_distributed_checkpoint,
    read_common,
    read_tracker,
)
from megatron_lite.training.checkpointing.load import load_model_state, read_weights
from megatron_lite.training.checkpointing.peft import PEFT_BASE, is_peft_checkpoint
from megatron_lite.training.checkpointing.reshard import read_saved_payload
from megatron_lite.training.checkpointing.safety import CheckpointError
from megatron_lite.training.checkpointing.torch_dist import load_distributed_weights

FLAG = "--pretrained-checkpoint"


def _one_line(root: str, iteration, err: Exception) -> str:
    line = f"{FLAG} {root}: iteration {iteration} cannot be read ({type(err).__name__}: {err})"
    return line.splitlines()[0]


def load_pretrained_weights(state, model) -> None:
    """``--pretrained-checkpoint``'s weights into ``model`` (model chunks, DDP-wrapped or not), at this
    run's layout whatever the saved one. Collective over the world; one CheckpointError on every rank
    for a checkpoint that is missing, of another architecture or not a base model."""
    cfg = state.cfg
    root = cfg.checkpoint.pretrained_checkpoint
    iteration, distributed, payload, error, note = None, False, None, None, None
    hf = is_hf_directory(root)
    try:
        if hf:
            load_hf_directory(root, model, cfg.model)  # this rank's shard; the agreement follows
        else:
            iteration = read_tracker(root, flag=FLAG)
            if iteration is None:
                raise CheckpointError(
                    f"{FLAG} {root}: holds no checkpoint (no {TRACKER} naming an iteration)"
                )
            saved = read_saved_payload(root, iteration)
            if is_peft_checkpoint(saved):
                base = saved[PEFT_BASE].get("pretrained_checkpoint")
                raise CheckpointError(
                    f"{FLAG} {root}: iteration {iteration} holds LoRA adapters only, not a base model; give "
                    f"its base ({base}) as {FLAG} and this directory as --load"
                )
            distributed = is_distributed_checkpoint(root, iteration)
            if distributed:
                error = resharded_model_error(root, read_common(root, iteration)["config"], cfg.model)
            else:
                payload, error, note = read_weights(root, iteration, True, model, cfg.model)
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # a config or payload of an unexpected shape: one line, on every rank
        error = _one_line(root, iteration, err)
    agree(error)
    if hf:
        if dist.get_rank() == 0:
            print(f" loaded the base model's weights from the Hugging Face model {root}", flush=True)
        return
    if distributed:
        load_distributed_weights(model, cfg.model, root, iteration, flag=FLAG)
    else:
        if note and dist.get_rank() == 0:
            print(note, flush=True)
        try:
            load_model_state(model, payload)
        except (KeyError, RuntimeError, ValueError, TypeError, AttributeError) as err:
            error = (
                f"{FLAG} {root}: iteration {iteration} does not match this model ({str(err).splitlines()[0]})"
            )
        del payload
        agree(error)
    if dist.get_rank() == 0:
        print(f" loaded the base model's weights from {root} at iteration {iteration}", flush=True)
