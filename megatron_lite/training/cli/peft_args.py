"""``--peft``: the flag that builds ``config.peft`` (Megatron-Bridge's ``ConfigContainer.peft``), which
the ``--lora-*`` rows of the flag table then fill in. Whether the result is a run megatron_lite can do
is config/validate/peft.py's check."""

from __future__ import annotations

import argparse

from megatron_lite.training.cli.flags import FLAGS
from megatron_lite.training.errors import ConfigError

# The PEFT methods --peft names; megatron_lite has Bridge's LoRA (its DoRA, canonical LoRA and
# VLM variants are not built).
METHODS = ("lora",)

# Each --lora-* flag: a field of the section --peft builds.
PEFT_FLAGS = [flag for flag, section, name, _kind, _help in FLAGS if section == "peft" and name]


def peft_section():
    """The class whose fields the ``peft`` rows of the flag table set (their help is its docstrings)."""
    from megatron_lite.peft import LoRA

    return LoRA


def peft_from_args(args: argparse.Namespace, config) -> None:
    """``config.peft``: a LoRA with Bridge's defaults under ``--peft lora``, else None; a ``--lora-*``
    flag without it is refused (it would change nothing)."""
    if args.peft is None:
        given = [flag for flag in PEFT_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            raise ConfigError(given[0], "needs --peft lora (it sets a field of LoRA fine-tuning)")
        return
    if args.peft not in METHODS:
        raise ConfigError(
            "--peft",
            f"{args.peft!r} is not supported; megatron_lite has Megatron-Bridge's LoRA only (--peft lora)",
        )
    # Bridge's rule: exclude_modules adapts every linear layer but those, with target_modules empty.
    only_excluded = args.lora_exclude_modules is not None and args.lora_target_modules is None
    config.peft = peft_section()(target_modules=[]) if only_excluded else peft_section()()
