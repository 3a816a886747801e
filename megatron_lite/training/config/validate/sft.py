"""Checks of an SFT run (``--sft``: config.dataset is an SFTDatasetConfig), run by validate before any
worker starts: the alignment its layout needs (Megatron-Bridge's rule), micro batches of one pack (as
Bridge), a text tokenizer, and every file read, rendered and tokenized, so bad input is one line
naming file and line and nothing is written."""

from __future__ import annotations

import math

from megatron_lite.training.errors import ConfigError
from megatron_lite.training.tokenizers import get_tokenizer


def sft_alignment(model) -> int:
    """Bridge's pad_seq_to_mult: lcm(2 cp with context parallelism, tp x cp with sequence parallelism)."""
    cp, tp = model.context_parallel_size, model.tensor_model_parallel_size
    cp_multiple = 2 * cp if cp > 1 else 1
    sp_multiple = cp * tp if model.sequence_parallel and tp > 1 else 1
    return math.lcm(cp_multiple, sp_multiple)


def check_sft(cfg) -> None:
    ds = cfg.dataset
    if not getattr(ds, "sft", False):
        return
    need = sft_alignment(cfg.model)
    if ds.pad_seq_to_mult is None:
        ds.pad_seq_to_mult = need
    elif ds.pad_seq_to_mult % need:
        raise ConfigError(
            "--sft-pad-seq-to-mult",
            f"{ds.pad_seq_to_mult} is not a multiple of {need}, which this layout needs (lcm of 2 x cp and, "
            "with sequence parallelism, tp x cp: Megatron-Bridge's rule)",
        )
    if ds.seq_length % ds.pad_seq_to_mult:
        raise ConfigError(
            "--seq-length", f"{ds.seq_length} is not a multiple of the SFT alignment {ds.pad_seq_to_mult}"
        )
    if ds.packing and cfg.train.micro_batch_size != 1:
        raise ConfigError(
            "--micro-batch-size",
            f"{cfg.train.micro_batch_size}: packed SFT takes one pack per micro batch (as Megatron-Bridge); "
            "give 1 and a longer --seq-length, or --no-sft-packing",
        )
    if cfg.tokenizer.tokenizer_type in (None, "NullTokenizer"):
        raise ConfigError(
            "--tokenizer-type",
            "--sft renders text: give GPT2BPETokenizer (--vocab-file, --merge-file) or HuggingFaceTokenizer "
            "(--tokenizer-model)",
        )
    ds.check_inputs(get_tokenizer(cfg))
