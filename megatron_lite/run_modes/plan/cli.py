"""``python -m megatron_lite.plan``'s command line: a recipe with overrides, or pretrain.py's flags
after ``--``; bad input is one line and exit 2; exit 0 when a layout fits, 1 when none does."""

from __future__ import annotations

import argparse
import sys

from megatron_lite.run_modes.dry_run import DryRunError
from megatron_lite.run_modes.preflight_json import json_path_arg
from megatron_lite.training.cli.ranges import RANGES, check_value
from megatron_lite.training.errors import ConfigError
from megatron_lite.utils.atomic_io import WriteFailedError

PROG = "python -m megatron_lite.plan"


def _raise(message: str):
    raise ConfigError("plan", message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Search the layouts (tp, pp, vp, cp, ep, dp, sequence parallelism, recompute, the distributed "
        "optimizer, the fused loss) that fit a job on N GPUs, rank them by the pipeline bubble, recompute's FLOPs "
        "and the bytes each GPU moves (not a measured time), and confirm the best by the dry run. The job: "
        "--recipe NAME [section.field=value ...], or pretrain.py's flags after --.",
    )
    parser.error = _raise  # one line, not argparse's usage block
    parser.add_argument("--recipe", metavar="NAME", help="A recipe (megatron_lite.recipes) to plan.")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value", help="The recipe's overrides.")
    parser.add_argument("--gpus", required=True, metavar="N", help="GPUs the job runs on.")
    parser.add_argument("--device-memory-gb", required=True, metavar="GB", help="Each GPU's memory.")
    parser.add_argument("--top", default="3", metavar="K", help="Layouts to list and confirm (default 3).")
    parser.add_argument("--no-dry-run", action="store_true", help="List from the predictions alone.")
    parser.add_argument("--html", metavar="FILE", help="Also draw the listed layouts side by side (HTML).")
    parser.add_argument("--json", metavar="FILE", help="Also write the plan as JSON.")
    return parser


def _positive(flag: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(flag, f"must be a positive whole number, got {value!r}")
    return number


def _base(args, flags: list[str] | None):
    """The job's ConfigContainer, not validated: the recipe with its overrides, or the flag set."""
    if args.recipe is not None and flags is not None:
        raise ConfigError("--recipe", "give a recipe or pretrain.py's flags after --, not both")
    if args.recipe is None and flags is None:
        raise ConfigError("--recipe", "needs a recipe NAME, or pretrain.py's flags after --")
    if args.recipe is None:
        if args.overrides:
            raise ConfigError(args.overrides[0], "overrides need --recipe; a flag set goes after --")
        from megatron_lite.training.cli.parser import build_parser as pretrain_parser
        from megatron_lite.training.cli.parser import config_from_args

        parser = pretrain_parser()
        parser.error = lambda message: _raise(f"pretrain.py's flags: {message}")
        return config_from_args(parser.parse_args(flags))
    from megatron_lite.recipes import apply_overrides, get_recipe

    return apply_overrides(get_recipe(args.recipe), list(args.overrides))


def main(argv: list[str] | None = None, out=None) -> int:
    """Plan, print, write --json / --html. Bad input: one line on stderr, exit 2."""
    from megatron_lite.run_modes.plan.planner import make_plan
    from megatron_lite.run_modes.plan.record import write_html, write_json

    argv = sys.argv[1:] if argv is None else argv
    out = sys.stdout if out is None else out
    flags = None
    if "--" in argv:
        cut = argv.index("--")
        argv, flags = argv[:cut], argv[cut + 1 :]
    try:
        args = build_parser().parse_args(argv)
        gpus = _positive("--gpus", args.gpus)
        top = _positive("--top", args.top)
        try:
            capacity = float(args.device_memory_gb)
            check_value("--device-memory-gb", capacity)
        except ValueError:
            raise ConfigError(
                "--device-memory-gb",
                f"must be {RANGES['--device-memory-gb']} (GB), got {args.device_memory_gb!r}",
            ) from None
        json_path = None if args.json is None else json_path_arg(args.json, "--json")
        html_path = None if args.html is None else json_path_arg(args.html, "--html")
        base = _base(args, flags)
        label = f"the recipe's own layout ({args.recipe})" if args.recipe else "the flag set's own layout"
        plan = make_plan(base, gpus, capacity, top, not args.no_dry_run, out, args.recipe, label)
    except ConfigError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except DryRunError as err:
        print(f"{PROG}: error: the dry run: {err}", file=sys.stderr)
        return 1
    try:
        if json_path:
            write_json(json_path, plan)
            print(f" wrote {json_path}", file=out)
        if html_path:
            what = f"recipe {args.recipe}" if args.recipe else "the flag set"
            write_html(html_path, plan, f"layout plan: {what} on {gpus} x {capacity:g} GB")
            print(f" wrote {html_path}", file=out)
    except WriteFailedError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    return 0 if plan.listed else 1
