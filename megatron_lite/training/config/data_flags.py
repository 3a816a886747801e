"""Megatron-LM's data and tokenizer flags, a part of the one flag table (flags.py joins them in)."""

from __future__ import annotations

# Megatron-LM's data and tokenizer flags; a field of None is mapped by data_arguments.dataset_from_args.
DATA_FLAGS: list[tuple[str, str, str | None, object, str]] = [
    ("--mock-data", "dataset", None, "store_true", "Synthetic data (the default without --data-path)."),
    ("--data-path", "dataset", "data_path", "+", "Prefixes, optionally weighted: 0.3 A 0.7 B, or A B."),
    ("--split", "dataset", "split", str, "Train,valid,test weights of --data-path (default: 969,30,1)."),
    ("--train-data-path", "dataset", None, "+", "Training blend (instead of --data-path and --split)."),
    ("--valid-data-path", "dataset", None, "+", "Validation blend (with --train-data-path)."),
    ("--test-data-path", "dataset", None, "+", "Test blend (with --train-data-path)."),
    ("--data-cache-path", "dataset", "path_to_cache", str, "Index cache (default: <prefix>/cache/)."),
    (
        "--num-workers",
        "dataset",
        "num_workers",
        int,
        "Data-loader worker processes per iterator (default: 2, as upstream; mock data: 0).",
    ),
    ("--eod-mask-loss", "dataset", "eod_mask_loss", "store_true", "No loss on end-of-document tokens."),
    (
        "--reset-position-ids",
        "dataset",
        "reset_position_ids",
        "store_true",
        "Restart position ids after each end-of-document token.",
    ),
    (
        "--reset-attention-mask",
        "dataset",
        "reset_attention_mask",
        "store_true",
        "Block attention across documents (not supported yet).",
    ),
    ("--tokenizer-type", "tokenizer", "tokenizer_type", str, "NullTokenizer, GPT2BPETokenizer, ..."),
    ("--tokenizer-model", "tokenizer", "tokenizer_model", str, "HuggingFaceTokenizer: directory or file."),
    ("--vocab-file", "tokenizer", "vocab_file", str, "GPT2BPETokenizer: vocab.json."),
    ("--merge-file", "tokenizer", "merge_file", str, "GPT2BPETokenizer: merges.txt."),
]
