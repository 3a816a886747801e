"""The values each numeric flag allows, checked before anything is derived from them.

One entry per numeric flag of ``pretrain.py --help`` (tests/training/test_flag_ranges.py fails for a flag
without one). Sizes and counts of things are integers >= 1; rates, coefficients and epsilons are finite;
fractions lie in their interval. Where 0 is allowed, the comment says what it means.
``ConfigContainer.validate`` checks the config fields of these flags first (so a bad value is never
divided by or handed to torch), and the command line checks every given value, including the flags a
mapping turns into other fields, before it maps them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from megatron_lite.training.cli.flags import FLAGS
from megatron_lite.training.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Finite values from ``low`` to ``high`` (either end open when ``*_open``; None: unbounded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = True

    def admits(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            return False
        if self.integer and value != int(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def __str__(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{kind} in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {_num(self.low)}"
        return kind


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


ONE_OR_MORE = Range(low=1)
ZERO_OR_MORE = Range(low=0)
NON_NEGATIVE = Range(low=0.0, integer=False)
POSITIVE = Range(low=0.0, low_open=True, integer=False)
PROBABILITY = Range(low=0.0, high=1.0, high_open=True, integer=False)  # dropout, Adam betas

RANGES: dict[str, Range] = {
    # Model
    **dict.fromkeys(
        (
            "--num-layers",
            "--hidden-size",
            "--num-attention-heads",
            "--ffn-hidden-size",
            "--kv-channels",
            "--seq-length",
            "--max-position-embeddings",
            "--vocab-size",
            "--make-vocab-size-divisible-by",
            "--num-query-groups",
            "--rotary-seq-len-interpolation-factor",
            "--recompute-num-layers",
        ),
        ONE_OR_MORE,
    ),
    "--init-method-std": POSITIVE,
    "--norm-epsilon": POSITIVE,
    "--layernorm-epsilon": POSITIVE,
    "--rotary-percent": Range(low=0.0, high=1.0, low_open=True, integer=False),
    "--rotary-base": Range(low=2),  # base 1 would give every channel pair the same frequency
    "--rope-scaling-factor": Range(low=1.0, integer=False),  # 1: the frequencies unchanged
    "--hidden-dropout": PROBABILITY,  # 0: no dropout (the default)
    "--attention-dropout": PROBABILITY,
    # Parallel layout
    **dict.fromkeys(
        (
            "--tensor-model-parallel-size",
            "--pipeline-model-parallel-size",
            "--context-parallel-size",
            "--virtual-pipeline-model-parallel-size",
            "--num-layers-per-virtual-pipeline-stage",
            "--num-virtual-stages-per-pipeline-rank",
            "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers",
            "--microbatch-group-size-per-virtual-pipeline-stage",
        ),
        ONE_OR_MORE,
    ),
    "--cross-entropy-fusion-chunk-tokens": ONE_OR_MORE,
    "--wgrad-deferral-limit": ZERO_OR_MORE,  # 0: defer every microbatch's output-layer wgrad
    # Mixture of experts
    "--num-experts": ZERO_OR_MORE,  # 0: a dense model (upstream maps it to None)
    **dict.fromkeys(
        (
            "--moe-ffn-hidden-size",
            "--moe-shared-expert-intermediate-size",
            "--moe-router-topk",
            "--expert-model-parallel-size",
            "--expert-tensor-parallel-size",
        ),
        ONE_OR_MORE,
    ),
    "--moe-aux-loss-coeff": NON_NEGATIVE,  # 0: no load-balancing loss (the default)
    "--moe-z-loss-coeff": NON_NEGATIVE,  # 0: no z-loss
    "--moe-router-topk-scaling-factor": POSITIVE,
    # Negative: no capacity limit (upstream's None); 0 is refused by validate/moe.py (every token dropped).
    "--moe-expert-capacity-factor": Range(integer=False),
    # Parameter-efficient fine-tuning
    "--lora-dim": ONE_OR_MORE,
    "--lora-alpha": ONE_OR_MORE,  # the adapter's scale is alpha / dim: 0 would switch it off
    "--lora-dropout": PROBABILITY,  # 0: no dropout (the default)
    # Training
    **dict.fromkeys(
        (
            "--micro-batch-size",
            "--global-batch-size",
            "--train-iters",
            "--train-samples",
            "--exit-interval",
            "--eval-interval",
        ),
        ONE_OR_MORE,
    ),
    "--eval-iters": ZERO_OR_MORE,  # 0: no validation, as upstream
    # Optimizer and schedule
    "--lr": NON_NEGATIVE,  # 0: a run that does not move the weights (with --min-lr 0)
    "--min-lr": NON_NEGATIVE,
    "--weight-decay": NON_NEGATIVE,  # 0: no decay
    "--adam-beta1": PROBABILITY,
    "--adam-beta2": PROBABILITY,
    "--adam-eps": POSITIVE,  # 0 divides by zero where a gradient's second moment is 0
    "--clip-grad": NON_NEGATIVE,  # 0: no clipping
    "--ddp-bucket-size": ONE_OR_MORE,
    "--lr-decay-iters": ONE_OR_MORE,
    "--lr-decay-samples": ONE_OR_MORE,
    "--lr-warmup-iters": ZERO_OR_MORE,  # 0: no warmup
    "--lr-warmup-samples": ZERO_OR_MORE,
    "--lr-warmup-fraction": Range(low=0.0, high=1.0, integer=False),
    "--lr-warmup-init": NON_NEGATIVE,
    "--start-weight-decay": NON_NEGATIVE,
    "--end-weight-decay": NON_NEGATIVE,
    # Data and seeds
    "--num-workers": ZERO_OR_MORE,  # 0: load in the training process
    "--sft-pad-seq-to-mult": ONE_OR_MORE,
    "--seed": Range(low=0, high=2**32 - 1),  # NumPy's seeds
    # Logging
    "--log-interval": ONE_OR_MORE,
    "--throughput-window-size": ONE_OR_MORE,
    "--timing-log-level": Range(low=0, high=2),  # 0 none, 1 step, 2 all
    "--tensorboard-log-interval": ONE_OR_MORE,
    "--tensorboard-queue-size": ONE_OR_MORE,
    # Checkpoints and launch
    "--save-interval": ONE_OR_MORE,
    "--ckpt-step": ZERO_OR_MORE,
    "--nproc-per-node": ONE_OR_MORE,
    "--distributed-timeout-minutes": ONE_OR_MORE,
    # Profiling (steps count from 0) and the preflight
    "--profile-step-start": ZERO_OR_MORE,
    "--profile-step-end": ZERO_OR_MORE,
    "--profile-ranks": ZERO_OR_MORE,
    "--device-memory-gb": POSITIVE,
}


def check_value(flag: str, value) -> None:
    """ConfigError naming ``flag`` and its range when ``value`` (or an element of a list) is outside it."""
    allowed = RANGES[flag]
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if not allowed.admits(item):
            raise ConfigError(flag, f"must be {allowed}, got {item!r}")


def check_parsed_flags(args) -> None:
    """Every numeric flag given on the command line, before any is mapped onto the config."""
    for flag in RANGES:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            check_value(flag, value)


# What validate divides by before its checks run (a 0 here would be a ZeroDivisionError): these ranges,
# and every value's finiteness, are checked first. The rest are checked after the sections' own checks,
# so a value upstream's checks refuse gets upstream's words.
DIVISORS = frozenset(
    {
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
        "--virtual-pipeline-model-parallel-size",
        "--micro-batch-size",
        "--global-batch-size",
        "--num-attention-heads",
        "--num-query-groups",
        "--make-vocab-size-divisible-by",
    }
)


def check_config_ranges(cfg, early: bool = False) -> None:
    """The config fields the numeric flags set, as the Python API may set them too; unset (None)
    fields are derived later and checked where they are. ``early``: only DIVISORS and finiteness.
    (The profiling section checks its own steps in ProfilingConfig.finalize, with upstream's words.)"""
    for flag, section, name, _kind, _help in FLAGS:
        if name is None or flag not in RANGES:
            continue
        value = getattr(getattr(cfg, section, None), name, None)
        if value is None:
            continue
        if early and flag not in DIVISORS:
            if isinstance(value, float) and not math.isfinite(value):
                check_value(flag, value)
            continue
        check_value(flag, value)
