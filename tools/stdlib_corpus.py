"""A small real-text corpus found on every machine with Python: the standard library's docstrings.

Writes one JSON line ``{"text": ...}`` per module, class and function docstring (read with ``ast``
from the source files, so nothing is imported or executed), in sorted file order. ``--vocab-dir``
also trains a GPT-2-style byte-level BPE on it and writes ``vocab.json`` + ``merges.txt`` (with
``<|endoftext|>``), usable as ``--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...``
where GPT-2's own files cannot be downloaded.

    python tools/stdlib_corpus.py --output data/stdlib.jsonl --vocab-dir data/bpe --vocab-size 4096
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator


def iter_docstrings(stdlib: str | None = None) -> Iterator[str]:
    """Every docstring of the standard library's Python sources, in a fixed order."""
    root = stdlib or sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # invalid escapes in old sources
                        tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 20:
                        yield doc


def write_jsonl(path: str, max_bytes: int | None = None) -> int:
    """Write the corpus (up to about ``max_bytes`` of text) atomically; returns the document count."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    count, size = 0, 0
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for doc in iter_docstrings():
            f.write(json.dumps({"text": doc}) + "\n")
            count, size = count + 1, size + len(doc.encode())
            if max_bytes is not None and size >= max_bytes:
                break
    os.replace(path + ".tmp", path)
    return count


def train_gpt2_bpe(jsonl: str, out_dir: str, vocab_size: int) -> None:
    """Train a byte-level BPE (GPT-2's pre-tokenizer) on ``jsonl``; write vocab.json and merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        with open(jsonl, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tok.train_from_iterator(texts(), trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.model.save(out_dir)  # vocab.json and merges.txt, GPT-2's file formats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSONL file to write.")
    parser.add_argument("--max-mb", type=float, default=None, help="Stop after about this much text.")
    parser.add_argument("--vocab-dir", default=None, help="Also train a GPT-2-style BPE and write it here.")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size.")
    args = parser.parse_args(argv)
    max_bytes = None if args.max_mb is None else int(args.max_mb * 1e6)
    count = write_jsonl(args.output, max_bytes)
    print(f"wrote {count} documents to {args.output}")
    if args.vocab_dir:
        train_gpt2_bpe(args.output, args.vocab_dir, args.vocab_size)
        print(f"wrote {args.vocab_dir}/vocab.json and {args.vocab_dir}/merges.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
