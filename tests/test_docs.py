"""Every command the README and docs/ show still parses: each ``--flag`` of a ``python <script>.py``
(or ``torchrun ... pretrain.py``) command in a fenced block or an inline code span is one that
script's own ``--help`` lists (for a sub-command, the sub-command's)."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest
from dist_helpers import run_script

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_SCRIPT = re.compile(r"(?:python|torchrun)\s.*?([\w/]+\.py)\b(.*)")


def _commands(text: str) -> list[str]:
    """Commands of fenced blocks (backslash continuations joined, a ``$ `` prompt dropped) and of inline
    code spans."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        found += [line.removeprefix("$ ") for line in joined.splitlines()]
    found += re.findall(r"`((?:python|torchrun) [^`]+)`", text)
    return [c for c in found if _SCRIPT.match(c.strip())]


def _script_and_flags(command: str) -> tuple[str, list[str], list[str]]:
    """(script, the sub-command words before its first flag, its --flags), placeholders (<...>) left out."""
    script, rest = _SCRIPT.match(command.strip()).groups()
    rest = re.sub(r"<[^>]*>", " ", rest)
    words = rest.split()
    sub = []
    for word in words:
        if word.startswith("-") or not re.fullmatch(r"[a-z][a-z_-]*", word):
            break
        sub.append(word)
    flags = [w.split("=")[0] for w in words if re.fullmatch(r"--[a-z0-9][a-z0-9_-]*(=.*)?", w)]
    return script, sub, flags


@functools.cache
def _help(script: str, sub: tuple[str, ...]) -> str:
    # Forked from the preloaded server: each script's own process without a fresh import of torch.
    run = run_script(REPO / script, [*sub, "--help"], REPO, timeout=120)
    assert run.returncode == 0, (script, sub, run.stderr[-500:])
    return run.stdout


def _documented() -> list[tuple[str, str]]:
    return [(doc.name, c) for doc in DOCS for c in _commands(doc.read_text())]


def test_the_docs_show_commands():
    """The extraction finds the commands it is meant to check (pretrain.py's, the tools', a bench's)."""
    scripts = {_script_and_flags(c)[0] for _, c in _documented()}
    assert {"pretrain.py", "tools/preprocess_data.py", "tools/checkpoint_conversion.py"} <= scripts


@pytest.mark.world
def test_every_documented_flag_exists():
    missing = []
    for doc, command in _documented():
        script, sub, flags = _script_and_flags(command)
        if not (REPO / script).exists():
            missing.append(f"{doc}: {script} does not exist")
            continue
        if not flags:
            continue  # nothing to check (a bench script without a parser runs on --help)
        text = _help(script, tuple(sub))
        listed = set(re.findall(r"--[a-z0-9][a-z0-9_-]*", text))
        missing += [f"{doc}: {script} {' '.join(sub)} {flag}" for flag in flags if flag not in listed]
    assert missing == []


@pytest.mark.world
def test_a_flag_no_script_has_is_caught(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("```\n$ python pretrain.py --num-layers 2 \\\n    --no-such-flag 3\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [doc])
    with pytest.raises(AssertionError, match="--no-such-flag"):
        test_every_documented_flag_exists()
