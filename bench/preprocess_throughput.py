"""Throughput of tools/preprocess_data.py with a GPT-2-style BPE: MB of text per second per worker.

Builds the corpus of tools/stdlib_corpus.py (repeated to --mb of text), trains a byte-level BPE of
--vocab-size on it, then times the whole preprocess_data.py command (start-up included) for each
--workers value. It prints the tool's own rate (its last progress line: from the tokenizer built to
the files written) and the wall-clock rate of the whole command, whose ~1-2 s of Python and torch
start-up is fixed and weighs only on small corpora. The target is at least 5 MB/s per worker.

    python bench/preprocess_throughput.py [--mb 8] [--vocab-size 32768] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import stdlib_corpus  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="MB of text to preprocess.")
    parser.add_argument("--vocab-size", type=int, default=32768, help="BPE vocabulary (GPT-2's is 50257).")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        once = os.path.join(tmp, "once.jsonl")
        stdlib_corpus.write_jsonl(once)
        stdlib_corpus.train_gpt2_bpe(once, tmp, args.vocab_size)
        corpus, text = os.path.join(tmp, "docs.jsonl"), open(once, encoding="utf-8").read()
        repeats = max(1, round(args.mb * 1e6 / len(text.encode())))
        with open(corpus, "w", encoding="utf-8") as f:
            f.write(text * repeats)
        size_mb = os.path.getsize(corpus) / 1e6
        print(f"corpus: stdlib docstrings x{repeats} = {size_mb:.1f} MB; BPE vocabulary {args.vocab_size}")
        for workers in args.workers:
            command = [
                sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus,
                "--output-prefix", os.path.join(tmp, f"out{workers}"), "--tokenizer-type", "GPT2BPETokenizer",
                "--vocab-file", os.path.join(tmp, "vocab.json"), "--merge-file", os.path.join(tmp, "merges.txt"),
                "--append-eod", "--workers", str(workers), "--log-interval", "100000000",
            ]  # fmt: skip
            start = time.perf_counter()
            job = subprocess.run(command, check=True, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            # The tool reports MiB/s, as upstream's progress line.
            tool_rate = float(re.findall(r"([0-9.]+) MB/s", job.stderr)[-1]) * 1024 * 1024 / 1e6
            wall_rate = size_mb / seconds
            print(
                f"workers {workers}: {tool_rate:.1f} MB/s = {tool_rate / workers:.1f} MB/s per worker "
                f"(whole command with start-up: {seconds:.2f} s, {wall_rate / workers:.1f} MB/s per worker; "
                f"target >= 5; {os.cpu_count()} CPUs here)"
            )


if __name__ == "__main__":
    main()
