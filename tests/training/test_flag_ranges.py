"""Every numeric flag of ``pretrain.py --help`` with 0, -1, nan and inf: a legitimate run (the table
says why the value means something) or one error line, exit 2, no traceback and no file written.

The flags come from the help text itself, so a numeric flag added later is walked here too (and must
get a range in training/cli/ranges.py's RANGES first).
"""

from __future__ import annotations

import math
import re
import runpy
from pathlib import Path

import pytest
from dist_helpers import PRETRAIN, SMALL_MODEL, parse_losses, run_pretrain

from megatron_lite.training.arguments import parse_args
from megatron_lite.training.cli.parser import build_parser
from megatron_lite.training.cli.ranges import RANGES
from megatron_lite.training.config import ConfigContainer, ConfigError

VALUES = ("0", "-1", "nan", "inf")

# The values that mean something, and what.
LEGITIMATE = {
    ("--hidden-dropout", "0"): "no dropout (the default)",
    ("--attention-dropout", "0"): "no dropout on attention probabilities (the default)",
    ("--wgrad-deferral-limit", "0"): "defer every microbatch's output-layer wgrad",
    ("--lr", "0"): "a run that leaves the weights where they are (with --min-lr 0)",
    ("--min-lr", "0"): "decay to zero",
    ("--weight-decay", "0"): "no weight decay",
    ("--adam-beta1", "0"): "no momentum",
    ("--adam-beta2", "0"): "the second moment of the latest gradient only",
    ("--clip-grad", "0"): "no gradient clipping",
    ("--lr-warmup-iters", "0"): "no warmup (the default)",
    ("--lr-warmup-samples", "0"): "no warmup (the default)",
    ("--lr-warmup-fraction", "0"): "no warmup",
    ("--lr-warmup-init", "0"): "warm up from zero (the default)",
    ("--num-workers", "0"): "load data in the training process",
    ("--seed", "0"): "a seed like any other",
    ("--timing-log-level", "0"): "no timers (the default)",
    ("--eval-iters", "0"): "no validation, as upstream",
    ("--profile-step-start", "0"): "profile from the first step",
    ("--profile-ranks", "0"): "profile rank 0 (the default)",
    ("--start-weight-decay", "0"): "weight decay rising from none",
    ("--end-weight-decay", "0"): "no weight decay (with --start-weight-decay 0)",
    ("--num-experts", "0"): "a dense model, as upstream",
    ("--moe-aux-loss-coeff", "0"): "no load-balancing loss (the default)",
    ("--moe-z-loss-coeff", "0"): "no z-loss",
    ("--moe-expert-capacity-factor", "-1"): "no capacity limit, as upstream",
}

# What a flag needs beside it to be judged on its own value.
CONTEXT = {
    "--lr": ["--min-lr", "0"],
    "--profile-step-start": ["--profile", "--use-pytorch-profiler"],
    "--profile-step-end": ["--profile", "--use-pytorch-profiler", "--profile-step-start", "0"],
    "--profile-ranks": ["--profile", "--use-pytorch-profiler"],
    "--device-memory-gb": ["--memory-preflight"],
    "--start-weight-decay": ["--end-weight-decay", "0.1", "--weight-decay-incr-style", "linear"],
    "--end-weight-decay": ["--start-weight-decay", "0", "--weight-decay-incr-style", "linear"],
    "--moe-z-loss-coeff": ["--num-experts", "4"],
}

NUMERIC_METAVARS = ("N", "X", "GB")


def _numeric_flags_of_help() -> list[str]:
    # The text `pretrain.py --help` prints (its parse goes through build_parser), built here: this runs
    # at collection, in the fast lane too, where a fresh interpreter would cost seconds.
    out = build_parser().format_help()
    pattern = rf"^\s+(--[\w-]+) (?:{'|'.join(NUMERIC_METAVARS)})\b"
    return sorted(set(re.findall(pattern, out, flags=re.M)))


NUMERIC_FLAGS = _numeric_flags_of_help()
CASES = [(flag, value) for flag in NUMERIC_FLAGS for value in VALUES]


def test_help_lists_numeric_flags_and_each_has_a_range():
    assert len(NUMERIC_FLAGS) >= 60 and "--micro-batch-size" in NUMERIC_FLAGS
    assert sorted(RANGES) == NUMERIC_FLAGS
    assert {flag for flag, _ in LEGITIMATE} <= set(NUMERIC_FLAGS)


def _no_worker(*args, **kwargs):
    raise AssertionError("the value passed validation: a worker would start")


@pytest.fixture(scope="module")
def pretrain_main():
    return runpy.run_path(PRETRAIN, run_name="pretrain_under_test")["main"]


def _outcome(flag: str, value: str, pretrain_main, cwd: Path, capsys) -> str | None:
    """None when ``flag value`` behaves as the table says, else what went wrong."""
    argv = [*CONTEXT.get(flag, []), flag, value]
    if (flag, value) in LEGITIMATE:
        parse_args(argv)
        err = capsys.readouterr().err
        return f"a legitimate value printed {err!r}" if err else None
    try:
        code = pretrain_main(argv)  # a refusal returns or exits before any worker starts
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    if code != 2:
        return f"exit {code}: {out[-300:]}{err[-300:]}"
    if err.count("\n") != 1 or not err.startswith("pretrain.py: error: ") or flag not in err:
        return f"not one line naming the flag: {err!r}"
    if "Traceback" in err:
        return f"a traceback: {err[-300:]}"
    if list(cwd.iterdir()):
        return f"wrote {sorted(p.name for p in cwd.iterdir())}"
    return None


def test_each_value_is_a_run_or_one_line(pretrain_main, tmp_path, monkeypatch, capsys):
    """One test over the table (a pytest case each would cost more than the cases themselves)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("megatron_lite.training.launcher.launch", _no_worker)
    failures = {}
    for flag, value in CASES:
        problem = _outcome(flag, value, pretrain_main, tmp_path, capsys)
        if problem:
            failures[f"{flag} {value}"] = problem
    assert failures == {}
    assert len(CASES) == 4 * len(NUMERIC_FLAGS)


@pytest.mark.world
def test_the_meaningful_values_train_together(tmp_path):
    combined = [
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "0", "--min-lr", "0",
        "--weight-decay", "0", "--adam-beta1", "0", "--adam-beta2", "0", "--clip-grad", "0",
        "--lr-warmup-iters", "0", "--lr-warmup-init", "0", "--num-workers", "0", "--seed", "0",
        "--timing-log-level", "0", "--eval-iters", "0", "--eval-interval", "1",
    ]  # fmt: skip
    assert {(f, v) for f, v in zip(combined[::2], combined[1::2]) if f != "--eval-interval"} <= set(
        LEGITIMATE
    )
    result = run_pretrain([*SMALL_MODEL, "--train-iters", "2", *combined], tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    losses = parse_losses(result.stdout)
    assert sorted(losses) == [1, 2] and all(math.isfinite(x) for x in losses.values())
    assert "validation loss" not in result.stdout


@pytest.mark.parametrize(
    "section,field,value,flag",
    [
        ("train", "micro_batch_size", 0, "--micro-batch-size"),
        ("model", "tensor_model_parallel_size", 0, "--tensor-model-parallel-size"),
        ("model", "pipeline_model_parallel_size", 0, "--pipeline-model-parallel-size"),
        ("optimizer", "lr", float("nan"), "--lr"),
        ("optimizer", "adam_eps", float("inf"), "--adam-eps"),
        ("model", "hidden_dropout", 1.0, "--hidden-dropout"),
    ],
)
def test_the_python_api_gets_the_same_ranges(section, field, value, flag):
    cfg = ConfigContainer()
    setattr(getattr(cfg, section), field, value)
    with pytest.raises(ConfigError, match=f"^{flag}: must be "):
        cfg.validate()
