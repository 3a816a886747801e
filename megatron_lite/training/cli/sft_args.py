"""``--sft``: the flag that makes ``config.dataset`` an SFTDatasetConfig (Megatron-LM's SFT data with
Megatron-Bridge's packed-sequence settings), which ``--data-path`` and the ``--sft-*`` rows of the flag
table then fill in. Flags of the other kind are refused, never ignored: an ``--sft-*`` flag without
``--sft``, and the pretraining datasets' document flags with it."""

from __future__ import annotations

import argparse

from megatron_lite.training.cli.flags import FLAGS
from megatron_lite.training.errors import ConfigError

# The --sft-* flags (fields of the section --sft builds).
SFT_FLAGS = [
    flag for flag, section, name, _k, _h in FLAGS if section == "dataset" and "-sft-" in flag and name
]

# Pretraining-dataset flags that mean nothing to SFT rows (each example is its own segment already).
GPT_ONLY_FLAGS = (
    "--mock-data",
    "--eod-mask-loss",
    "--reset-position-ids",
    "--reset-attention-mask",
    "--data-cache-path",
)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def sft_section():
    """The class whose fields the --sft-* rows set (their help is its docstrings)."""
    from megatron_lite.data.sft.config import SFTDatasetConfig

    return SFTDatasetConfig


def sft_from_args(args: argparse.Namespace, config) -> bool:
    """Before the flags are copied: under ``--sft`` ``config.dataset`` becomes an SFTDatasetConfig
    with the demo section's row length and seed; True when it did."""
    if not args.sft:
        given = [flag for flag in SFT_FLAGS if getattr(args, _dest(flag)) is not None]
        if given:
            raise ConfigError(given[0], "needs --sft (it sets how the SFT data is read)")
        return False
    for flag in GPT_ONLY_FLAGS:
        if getattr(args, _dest(flag)) is not None:
            raise ConfigError(
                flag, "is a pretraining-data flag; --sft rows hold whole examples, each its own segment"
            )
    if args.data_path is None and args.train_data_path is None:
        raise ConfigError("--sft", "needs --data-path (JSONL of messages or input / output, or pack files)")
    mock = config.dataset
    config.dataset = sft_section()(seq_length=mock.seq_length, random_seed=mock.random_seed)
    return True
