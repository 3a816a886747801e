"""A small real corpus for data tests: stdlib docstrings as JSONL and a GPT-2-style BPE trained on it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from dist_helpers import REPO


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its pool workers' functions pickle by module name
    spec.loader.exec_module(module)
    return module


stdlib_corpus = _tool("stdlib_corpus")


def make_corpus(root: Path, max_bytes: int, vocab_size: int) -> tuple[Path, Path, Path]:
    """``(docs.jsonl, vocab.json, merges.txt)`` under ``root``."""
    stdlib_corpus.write_jsonl(str(root / "docs.jsonl"), max_bytes=max_bytes)
    stdlib_corpus.train_gpt2_bpe(str(root / "docs.jsonl"), str(root), vocab_size=vocab_size)
    return root / "docs.jsonl", root / "vocab.json", root / "merges.txt"
