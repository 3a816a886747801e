"""``--use-checkpoint-args`` (Megatron-LM's flag): the model's architecture from the checkpoint that will
be loaded (``--load`` when it holds one, else ``--pretrained-checkpoint``), so a finetune needs no
architecture flags.

It runs while the flags are mapped, before validation, in the launcher and again in every worker, so
all of them build the same model; a checkpoint that is missing or cannot be read is one ConfigError
(exit 2) before any worker starts. The parallel layout stays this run's: a weights-only load reshards.
"""

from __future__ import annotations

import argparse
import warnings

import torch.nn.functional as F

from megatron_lite.core import activations
from megatron_lite.training.checkpointing.compat import architecture_fields
from megatron_lite.training.checkpointing.hf_directory import hf_directory_model, pretrained_hf_directory
from megatron_lite.training.checkpointing.load import resolve_checkpoint
from megatron_lite.training.checkpointing.reshard import read_saved_config
from megatron_lite.training.checkpointing.safety import CheckpointError
from megatron_lite.training.cli.flags import FLAGS
from megatron_lite.training.cli.parallel_args import virtual_pipeline_from_args
from megatron_lite.training.errors import ConfigError

FLAG = "--use-checkpoint-args"

# The architecture, and the fields that change what the same weights compute. padded_vocab_size is
# derived (from vocab_size, the padding multiple and this run's tp); seq_length stays this run's.
_EXTRA_FIELDS = (
    "vocab_size",
    "make_vocab_size_divisible_by",
    "layernorm_epsilon",
    "max_position_embeddings",
    "rotary_interleaved",
    "rope_scaling",
    "rope_scaling_factor",
    "qk_layernorm",
    "init_method_std",
    "apply_residual_connection_post_layernorm",
)

# Checkpoints record the activation by name (safety.plain); names an older file pickled as functions too.
_ACTIVATIONS = {
    "gelu": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "squared_relu": activations.squared_relu,
    "openai_gelu": activations.openai_gelu,
}


def _fields() -> list[str]:
    names = [n for n in architecture_fields() if n != "padded_vocab_size"]
    return names + [n for n in _EXTRA_FIELDS if n not in names]


def saved_activation(root: str, value, flag: str = FLAG):
    """The activation a checkpoint recorded by name (ConfigError naming ``flag`` for one unknown)."""
    name = getattr(value, "__name__", value)
    if name not in _ACTIVATIONS:
        raise ConfigError(
            flag,
            f"{root}'s model uses the activation {name!r}, which megatron_lite cannot build "
            f"(it knows {', '.join(sorted(_ACTIVATIONS))})",
        )
    return _ACTIVATIONS[name]


def _saved_model(config) -> tuple[str, dict]:
    """(root, the saved config's model section) of the checkpoint this run will load."""
    config.checkpoint.finalize()  # its own errors first: a missing --pretrained-checkpoint, --ckpt-step alone
    try:
        hf_dir = pretrained_hf_directory(config.checkpoint)  # HF directory: the model of its config.json
        if hf_dir is not None:
            return hf_dir, hf_directory_model(hf_dir)
        root, iteration, _ = resolve_checkpoint(config.checkpoint)
        if iteration is None:
            load = config.checkpoint.load
            raise ConfigError(
                FLAG,
                f"--load {load} holds no checkpoint to take the model from"
                if load
                else "needs the checkpoint to load: give --load or --pretrained-checkpoint",
            )
        return root, read_saved_config(root, iteration)["model"]
    except CheckpointError as err:
        raise ConfigError(FLAG, str(err)) from None


def model_from_checkpoint(args: argparse.Namespace, config) -> None:
    """Set ``config.model``'s architecture to the saved one's (Megatron-LM's ``load_args_from_checkpoint``
    for the model). A flag that gave another value gives way, with a note."""
    root, saved = _saved_model(config)
    m = config.model
    given = {
        name: flag
        for flag, section, name, _kind, _help in FLAGS
        if section == "model" and name and getattr(args, flag[2:].replace("-", "_")) is not None
    }
    overridden = []
    for name in _fields():
        if name not in saved or not hasattr(m, name):
            continue  # a field the saving version did not have, or this one does not
        value = saved_activation(root, saved[name]) if name == "activation_func" else saved[name]
        if name in given and getattr(m, name) != value:
            overridden.append(f"{given[name]} gives way to the checkpoint's {name}={value!r}")
        setattr(m, name, value)
    if overridden:
        warnings.warn(f"{FLAG}: {'; '.join(overridden)}", stacklevel=2)
    if args.num_layers_per_virtual_pipeline_stage is not None:
        virtual_pipeline_from_args(args, m)  # it counts the layers: the saved ones
    if config.tokenizer.tokenizer_type is not None:
        # The weights fix the vocabulary; validation checks it holds the tokenizer's.
        config.tokenizer.use_tokenizer_vocab_size = False
