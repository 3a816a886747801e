"""Tokenize and pack SFT data offline (Megatron-Bridge's scripts/training/prepare_gpt_sft_packed_data.py).

    python tools/prepare_sft_data.py --input chats.jsonl --output data/chats_4096.safetensors \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf/llama --seq-length 4096

reads JSONL of ``messages`` (Megatron-LM) or ``input`` / ``output`` (Megatron-Bridge), renders each
example as training does (the tokenizer's chat template, else the default format; see
megatron_lite/data/sft/prompt.py), and packs them with first-fit-decreasing (or ``first_fit_shuffle``
from ``--seed``) into rows of ``--seq-length``. The same input and settings give the same file, byte
for byte. The file is safetensors (no pickle) and is given to training as
``pretrain.py --sft --data-path FILE --seq-length N``; the split is then taken over its packs.
Bad input (a line that is not JSON, a conversation without an assistant turn, an example longer than
the pack) is one line naming file and line, exit code 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_lite.data.sft.build import load_jsonl, rows_for, summary_line  # noqa: E402
from megatron_lite.data.sft.config import TRUNCATIONS, SFTDatasetConfig  # noqa: E402
from megatron_lite.data.sft.packed_file import save_packs, tokenizer_identity  # noqa: E402
from megatron_lite.data.sft.packing import PACKING_ALGOS  # noqa: E402
from megatron_lite.training.errors import ConfigError  # noqa: E402
from megatron_lite.training.tokenizers import TokenizerConfig, build_tokenizer  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prepare_sft_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="JSONL of messages or input / output pairs.")
    parser.add_argument("--output", required=True, help="The pack file to write (.safetensors).")
    parser.add_argument(
        "--seq-length", type=int, required=True, help="Positions per pack (the run's --seq-length)."
    )
    parser.add_argument("--packing-algorithm", default="first_fit_decreasing", choices=PACKING_ALGOS)
    parser.add_argument(
        "--pad-seq-to-mult", type=int, default=1, help="Align each example (CP / SP; the run's)."
    )
    parser.add_argument(
        "--truncation", default="error", choices=TRUNCATIONS, help="An example longer than a pack."
    )
    parser.add_argument("--no-chat-template", action="store_true", help="Use the default format.")
    parser.add_argument(
        "--seed", type=int, default=1234, help="first_fit_shuffle's order (the run's --seed)."
    )
    group = parser.add_argument_group("tokenizer (as pretrain.py's)")
    group.add_argument(
        "--tokenizer-type", required=True, choices=("GPT2BPETokenizer", "HuggingFaceTokenizer")
    )
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json.")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt.")
    group.add_argument("--tokenizer-model", default=None, help="Local tokenizer directory or tokenizer.json.")
    return parser


def prepare(args: argparse.Namespace) -> str:
    """Write the pack file; returns the summary lines."""
    if not args.output.endswith(".safetensors"):
        raise ConfigError("--output", f"{args.output}: name the pack file *.safetensors")
    if args.seq_length < 2 or args.pad_seq_to_mult < 1 or args.seq_length % args.pad_seq_to_mult:
        raise ConfigError("--seq-length", "must be at least 2 and a multiple of --pad-seq-to-mult")
    tokenizer = build_tokenizer(
        TokenizerConfig(
            tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
        )
    )
    chat = not args.no_chat_template
    examples, stats, renderer = load_jsonl(
        args.input, tokenizer, args.seq_length, args.truncation, args.pad_seq_to_mult, chat
    )
    config = SFTDatasetConfig(
        seq_length=args.seq_length,
        data_path=[args.input],
        packing_algorithm=args.packing_algorithm,
        pad_seq_to_mult=args.pad_seq_to_mult,
        random_seed=args.seed,
    )
    packs = rows_for(examples, config)
    metadata = {
        "seq_length": args.seq_length,
        "pad_seq_to_mult": args.pad_seq_to_mult,
        "packing_algorithm": args.packing_algorithm,
        "seed": args.seed,
        "tokenizer": tokenizer_identity(tokenizer),
        "source": os.path.basename(args.input),
    }
    save_packs(args.output, examples, packs, metadata)
    used = int(examples.segment_lengths.sum())
    padding = 1 - used / (len(packs) * args.seq_length)
    return (
        f"{summary_line(args.input, stats, args.seq_length, renderer)}\n"
        f"> wrote {args.output}: {len(examples)} examples in {len(packs)} packs of {args.seq_length} "
        f"({args.packing_algorithm}), {padding:.1%} padding"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(prepare(args))
    except ConfigError as err:
        print(f"prepare_sft_data.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
