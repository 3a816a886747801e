"""A local Hugging Face model directory as ``--pretrained-checkpoint`` (config.json and *.safetensors,
no latest_checkpointed_iteration.txt): its architecture serves ``--use-checkpoint-args`` and its
weights load at any layout, through the bridge.

The bridge sits above training (it writes checkpoints), so it is never imported from here: importing
``megatron_lite.bridge`` registers its functions, and pretrain.py registers a factory that imports the
bridge (and transformers, seconds) only when a run names such a directory."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable

import torch.distributed as dist

from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.layout import TRACKER, read_tracker
from megatron_lite.training.checkpointing.safety import CheckpointError

# A factory giving (model fields of a directory, weight loader); called on first use.
_factory: list[Callable | None] = [None]


def is_hf_directory(path: str | None) -> bool:
    """A Hugging Face model directory, not a megatron_lite / Megatron-LM checkpoint."""
    return bool(
        path
        and os.path.isfile(os.path.join(path, "config.json"))
        and glob.glob(os.path.join(glob.escape(path), "*.safetensors"))
        and not os.path.exists(os.path.join(path, TRACKER))
    )


def register_hf_directory_loader(factory: Callable) -> None:
    """``factory()`` gives ``(model_fields(path) -> dict, load(path, model, model_config))``."""
    _factory[0] = factory


def _functions(path: str):
    if _factory[0] is None:
        raise CheckpointError(
            f"--pretrained-checkpoint {path} is a Hugging Face directory, loaded through megatron_lite.bridge: "
            "import it first (pretrain.py does)"
        )
    return _factory[0]()


def hf_directory_model(path: str) -> dict:
    """The model config (a saved config's ``model`` section) the directory's config.json makes."""
    return _functions(path)[0](path)


def load_hf_directory(path: str, model, model_config) -> None:
    """This rank's shard of the directory's weights into the model chunks; CheckpointError (one line)
    when they do not fit. Not collective."""
    _functions(path)[1](path, model, model_config)


def pretrained_hf_directory(cfg) -> str | None:
    """The run's ``--pretrained-checkpoint`` when it is a Hugging Face directory and is what loads
    (``--load`` holds no checkpoint to resume); None otherwise."""
    if cfg.ckpt_step is not None or not is_hf_directory(cfg.pretrained_checkpoint):
        return None
    if cfg.load is not None and read_tracker(cfg.load) is not None:
        return None
    return cfg.pretrained_checkpoint


def finetune_from_hf_directory(state, model, optimizer, scheduler, path: str) -> int:
    """``load_checkpoint`` for a Hugging Face directory: the weights only, as a finetune from a
    pretrained checkpoint (fresh optimizer, the schedule from iteration 0). Collective: every rank
    hears of any rank's error before the run goes on."""
    error = None
    try:
        load_hf_directory(path, model, state.cfg.model)
    except CheckpointError as err:
        error = str(err)
    agree(error)
    optimizer.reload_model_params(None)  # the fp32 main parameters from the weights just read
    scheduler.step(0)
    if dist.get_rank() == 0:
        print(f" loaded the Hugging Face model {path} (weights only) through the bridge", flush=True)
    return 0
