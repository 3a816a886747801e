"""Megatron-LM's data and tokenizer flags (config.flags has their rows), mapped onto config.dataset and
config.tokenizer where a row cannot say how.

``--data-path`` (or ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``) swaps the
demo's mock dataset section for a real GPTDatasetConfig, as Megatron-Bridge's recipes do; the blend
itself is parsed by GPTDatasetConfig.finalize (data_path -> blend, as upstream). As in Megatron-LM the
tokenizer defines the model's vocabulary, and ``--vocab-size`` is the NullTokenizer's size only.
"""

from __future__ import annotations

import argparse
import warnings

from megatron_lite.training.cli.sft_args import sft_from_args
from megatron_lite.training.config.data import GPTDatasetConfig, parse_blend
from megatron_lite.training.errors import ConfigError

LEGACY_DEFAULT_SPLIT = "969, 30, 1"  # Megatron-LM's, used (with a warning) when --split is not given
_PER_SPLIT = ("--train-data-path", "--valid-data-path", "--test-data-path")


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def uses_real_data(args: argparse.Namespace) -> bool:
    return args.data_path is not None or any(getattr(args, _dest(f)) is not None for f in _PER_SPLIT)


def prepare_dataset_section(args: argparse.Namespace, config) -> None:
    """Before the flags are copied: real data gets a GPTDatasetConfig (the demo's section is mock), SFT
    data (--sft) an SFTDatasetConfig."""
    if sft_from_args(args, config):
        return
    if not uses_real_data(args):
        return
    if args.mock_data:
        raise ConfigError("--mock-data", "and --data-path / --train-data-path exclude each other; give one")
    mock = config.dataset
    config.dataset = GPTDatasetConfig(
        seq_length=mock.seq_length,
        random_seed=mock.random_seed,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # The attention is causal by construction and takes no mask: a [s, s] mask per sample
        # would only cost memory.
        create_attention_mask=False,
    )


def dataset_from_args(args: argparse.Namespace, config) -> None:
    """After the flags are copied: the per-split blends, the legacy default split, the tokenizer's
    vocabulary (Megatron-LM: the tokenizer defines it; --vocab-size sizes a NullTokenizer only)."""
    ds, tok = config.dataset, config.tokenizer
    per_split = [getattr(args, _dest(f)) for f in _PER_SPLIT]
    if any(p is not None for p in per_split):
        if args.data_path is not None:
            raise ConfigError("--train-data-path", "and --data-path exclude each other; give one")
        if args.split is not None:
            raise ConfigError("--split", "divides --data-path; --train-data-path and co. are taken whole")
        if per_split[0] is None:
            raise ConfigError("--train-data-path", "is required with --valid-data-path / --test-data-path")
        ds.blend_per_split = [
            None if p is None else parse_blend(flag, p) for flag, p in zip(_PER_SPLIT, per_split)
        ]
    elif args.data_path is not None and args.split is None:
        warnings.warn(
            "Please specify --split when using --data-path. Using legacy default value of "
            f'"{LEGACY_DEFAULT_SPLIT}"',
            stacklevel=2,
        )
        ds.split = LEGACY_DEFAULT_SPLIT
    if not uses_real_data(args):
        for flag in ("--split", "--data-cache-path", "--eod-mask-loss", "--reset-position-ids"):
            if getattr(args, _dest(flag)) not in (None, False):
                raise ConfigError(flag, "needs real data (--data-path); the mock sequences have no documents")
    if tok.tokenizer_type is None:
        return
    tok.use_tokenizer_vocab_size = True
    if tok.tokenizer_type == "NullTokenizer":
        tok.vocab_size = args.vocab_size  # None: model.vocab_size - 1 (TokenizerConfig)
    elif args.vocab_size is not None:
        warnings.warn(
            f"--vocab-size {args.vocab_size} is ignored: the vocabulary is {tok.tokenizer_type}'s "
            "(as Megatron-LM; --vocab-size sizes a NullTokenizer)",
            stacklevel=2,
        )
