#!/usr/bin/env python
"""The layout planner on Bridge's Llama-3-70B recipe: 32 and 128 GPUs of 80 GB, the best three splits
of each confirmed by the dry run.

    python bench/plan_llama3_70b.py [--no-dry-run] [--gpus 32 128] [--out DIR]

Runs ``python -m megatron_lite.plan --recipe llama3_70b_pretrain_config --gpus N --device-memory-gb 80``
in this process for each N and prints the plan (docs/plan.md quotes it), then one summary line per N:
the search's wall and CPU time, the dry runs' time, and per listed layout its largest dry-run
difference from the prediction. With ``--out DIR``, also each plan's page and JSON there
(``plan_llama3_70b_<N>gpu.html`` / ``.json``). The search is a few seconds of CPU; each dry run of a 70B layout is
tens of seconds on a 2-core machine (more when the cores are shared). No timing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_lite.recipes import get_recipe  # noqa: E402
from megatron_lite.run_modes.plan import make_plan  # noqa: E402
from megatron_lite.run_modes.plan.confirm import stage_differences  # noqa: E402
from megatron_lite.run_modes.plan.record import write_html, write_json  # noqa: E402

RECIPE = "llama3_70b_pretrain_config"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--no-dry-run", action="store_true")
    parser.add_argument("--out", metavar="DIR", help="Also write each plan's page and JSON into DIR.")
    args = parser.parse_args()
    summary = []
    for gpus in args.gpus:
        print(
            f"$ python -m megatron_lite.plan --recipe {RECIPE} --gpus {gpus} --device-memory-gb 80",
            flush=True,
        )
        plan = make_plan(get_recipe(RECIPE), gpus, 80, dry_run=not args.no_dry_run, recipe=RECIPE,
                         given_label=f"the recipe's own layout ({RECIPE})")  # fmt: skip
        if args.out:
            stem = os.path.join(args.out, f"plan_llama3_70b_{gpus}gpu")
            write_json(stem + ".json", plan)
            write_html(stem + ".html", plan, f"layout plan: recipe {RECIPE} on {gpus} x 80 GB")
        worst = [
            max((abs(x) for x in stage_differences(c)), default=0.0) if c.dry else None for c in plan.listed
        ]
        summary.append(
            f"{gpus} GPUs: search {plan.result.seconds:.1f} s ({plan.result.cpu_seconds:.1f} s CPU), "
            f"{len(plan.result.fitting)} fit of {plan.result.predicted} predicted; dry runs {plan.dry_seconds:.1f} s; "
            "largest dry-run difference per listed layout: "
            + ", ".join("-" if w is None else f"{w:.2%}" for w in worst)
        )
        print(flush=True)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
