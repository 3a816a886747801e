#!/usr/bin/env python
"""Packed against unpacked SFT on a real corpus made from the standard library: padding tokens per step
and iteration time, side by side.

    python bench/sft_packing.py [--examples 2000] [--seq-length 512] [--iters 12]

The corpus: one conversation per documented standard-library function or method (a system line, the user asking
what ``module.function(args)`` does, the assistant answering with its docstring), read with ``ast``
(nothing imported), and a GPT-2-style BPE trained on the docstrings (tools/stdlib_corpus.py). Each
mode is one real ``pretrain.py --sft`` run on it (one process, a small GPT, micro batches of one row,
the same global batch of rows): packed rows (first-fit-decreasing) and ``--no-sft-packing`` (one
example per row). Padding is counted on the very rows each run trains on (positions no example holds);
the time is pretrain.py's own ``elapsed time per iteration``, the median after two warm-up steps. No
figure is asserted, but the padding packing removes is printed beside the issue's bar (80%).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

import stdlib_corpus  # noqa: E402
from stdlib_chats import write_conversations  # noqa: E402

from megatron_lite.data.base import DatasetBuildContext  # noqa: E402
from megatron_lite.data.sft.config import SFTDatasetConfig  # noqa: E402
from megatron_lite.training.tokenizers import TokenizerConfig, build_tokenizer  # noqa: E402

MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --micro-batch-size 1"


def padding_per_step(
    config: SFTDatasetConfig, tokenizer, steps: int, rows_per_step: int
) -> tuple[float, float]:
    """(padding tokens, examples) per step, averaged over the rows the run's first ``steps`` steps read."""
    train, _, _ = config.build_datasets(DatasetBuildContext(steps * rows_per_step, 0, 0, tokenizer=tokenizer))
    pad = examples = 0
    for i in range(steps * rows_per_step):
        members = train.rows[train._row(i)]
        pad += config.seq_length - sum(int(train.examples.segment_lengths[m]) for m in members)
        examples += len(members)
    return pad / steps, examples / steps


def iteration_ms(argv: list[str]) -> float:
    """Median ``elapsed time per iteration`` of a pretrain.py run, after two warm-up steps."""
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "pretrain.py"), *argv], env=env, capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"sft_packing.py: pretrain.py failed:\n{done.stderr[-2000:]}")
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", done.stdout)]
    return statistics.median(times[2:] or times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="Conversations in the corpus.")
    parser.add_argument("--seq-length", type=int, default=512, help="Positions per row (the pack size).")
    parser.add_argument("--rows-per-step", type=int, default=8, help="Global batch size, in rows.")
    parser.add_argument("--iters", type=int, default=12, help="Training steps per mode.")
    parser.add_argument(
        "--workdir", default=None, help="Where the corpus and tokenizer go (default: a temp dir)."
    )
    args = parser.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="sft_packing_")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "stdlib_sft.jsonl")
    if not os.path.isfile(os.path.join(work, "vocab.json")):
        stdlib_corpus.write_jsonl(os.path.join(work, "docs.jsonl"), max_bytes=2_000_000)
        stdlib_corpus.train_gpt2_bpe(os.path.join(work, "docs.jsonl"), work, vocab_size=2048)
    n = write_conversations(data, args.examples)
    tok_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(work, "vocab.json")]
    tok_flags += ["--merge-file", os.path.join(work, "merges.txt")]
    tokenizer = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=os.path.join(work, "vocab.json"),
            merge_file=os.path.join(work, "merges.txt"),
        )
    )
    s, g = args.seq_length, args.rows_per_step
    common = [
        "--sft",
        "--data-path",
        data,
        "--split",
        "100,0,0",
        "--seq-length",
        str(s),
        "--sft-truncation",
        "right",
    ]
    common += [*tok_flags, *MODEL.split(), "--global-batch-size", str(g), "--train-iters", str(args.iters)]
    common += ["--log-interval", "1", "--eval-iters", "0"]
    print(f"corpus: {n} standard-library conversations, rows of {s} positions, {g} rows per step (mbs 1)")
    results = {}
    for mode, extra in (("packed", []), ("unpacked", ["--no-sft-packing"])):
        config = SFTDatasetConfig(
            seq_length=s, data_path=[data], packing=not extra, truncation="right", split="100,0,0"
        )
        config.finalize()
        pad, examples = padding_per_step(config, tokenizer, args.iters, g)
        results[mode] = (pad, examples, iteration_ms(common + extra))
    print(f"{'':<28}{'packed':>12}{'unpacked':>12}")
    labels = ("padding tokens per step", "examples per step", "iteration time (ms)")
    for i, label in enumerate(labels):
        print(f"{label:<28}{results['packed'][i]:>12.1f}{results['unpacked'][i]:>12.1f}")
    rate = {m: r[1] / r[2] * 1000 for m, r in results.items()}
    print(f"{'examples per second':<28}{rate['packed']:>12.1f}{rate['unpacked']:>12.1f}")
    removed = 1 - results["packed"][0] / results["unpacked"][0]
    print(f"padding removed by packing: {removed:.1%} (the issue's bar: at least 80%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
