"""A plan from start to end: search, list the best distinct splits, confirm them by the dry run, say
why, and where the job's own layout stands."""

from __future__ import annotations

import copy
import sys
import warnings
from dataclasses import dataclass, field

from megatron_lite.run_modes.plan.confirm import confirm, distinct_grids, exactly
from megatron_lite.run_modes.plan.layouts import layout_of
from megatron_lite.run_modes.plan.report import (
    dry_run_note,
    given_lines,
    header_lines,
    print_candidate,
    why_first,
    why_not_fit,
)
from megatron_lite.run_modes.plan.search import SearchResult, nearest_miss, predict_candidate, search
from megatron_lite.training.config import runtime_config_update
from megatron_lite.training.errors import ConfigError


@dataclass
class Plan:
    """A finished plan: the search, the listed (and dry-run-confirmed) layouts, and the job's own."""

    gpus: int
    capacity_gb: float
    result: SearchResult
    listed: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    """Listed by the prediction but dropped: their dry run did not fit."""
    given: object = None
    """The job's own layout as a Candidate, or why the validation refused it (a string)."""
    given_label: str = "the job's own layout"
    dry_seconds: float = 0.0


def given_candidate(base, gpus: int, capacity_gb: float):
    """The job's own layout on ``gpus`` GPUs, predicted and judged; the refusal's text when invalid."""
    config = copy.deepcopy(base)
    config.dist.nproc_per_node = gpus
    config.env_vars = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runtime_config_update(config)
    except (ConfigError, ValueError, AssertionError) as err:
        return str(err)
    return predict_candidate(config, layout_of(config), capacity_gb)


def make_plan(
    base,
    gpus: int,
    capacity_gb: float,
    top: int = 3,
    dry_run: bool = True,
    out=sys.stdout,
    recipe: str | None = None,
    given_label: str = "the job's own layout",
) -> Plan:
    """Search ``base``'s layouts (a ConfigContainer, not validated) on ``gpus`` GPUs of ``capacity_gb``
    GB, list the ``top`` best distinct splits (with ``dry_run``, those whose dry run fits, each checked
    against its prediction) and print it all to ``out``. ConfigError when no layout validates."""
    given = given_candidate(base, gpus, capacity_gb)
    result = search(base, gpus, capacity_gb)
    if not result.predicted and isinstance(given, str):
        flag, _, message = given.partition(": ")
        raise ConfigError(flag, f"{message} (no layout of this job validates on {gpus} GPUs)")
    plan = Plan(gpus, capacity_gb, result, given=given, given_label=given_label)
    what = f"recipe {recipe}" if recipe else "the flag set"
    for line in header_lines(result, gpus, capacity_gb, what):
        print(f" {line}", file=out)
    ranked = distinct_grids(result.fitting)
    if dry_run and ranked:
        print(
            f" confirming the best {top} distinct splits by the dry run ({dry_run_note()})",
            file=out,
            flush=True,
        )
        plan.listed, plan.dropped, plan.dry_seconds = confirm(ranked, top, capacity_gb, out)
    else:
        plan.listed = ranked[:top]
        for candidate in plan.listed:
            exactly(candidate, capacity_gb)
    for i, candidate in enumerate(plan.listed):
        print_candidate(i + 1, candidate, gpus, recipe, out)
    for candidate in plan.dropped:
        print(
            f" dropped by its dry run: {candidate.layout.describe()}: {why_not_fit(candidate, capacity_gb)}",
            file=out,
        )
    for line in why_first(plan.listed, capacity_gb):
        print(f" {line}", file=out)
    for line in given_lines(given, result.fitting, capacity_gb, given_label):
        print(f" {line}", file=out)
    if not plan.listed:
        miss = nearest_miss(result.rejected + plan.dropped, capacity_gb)
        if miss is None:
            print(" nothing fits, and no layout was predicted", file=out)
        else:
            print(
                f" nothing fits; the nearest miss is {miss.layout.describe()}: {why_not_fit(miss, capacity_gb)}",
                file=out,
            )
    times = f" search {result.seconds:.1f} s (no dry run)"
    if dry_run and ranked:
        times = f" search {result.seconds:.1f} s; dry runs {plan.dry_seconds:.1f} s ({len(plan.listed) + len(plan.dropped)} layouts)"
    print(times, file=out)
    return plan
