"""The plan as data (``--json``) and as a picture (``--html``: one panel per listed layout, the dry
run's measured peak beside the prediction, the ranking figures under each), both written atomically."""

from __future__ import annotations

import dataclasses
import json

from megatron_lite.run_modes.plan.confirm import stage_differences
from megatron_lite.run_modes.plan.figures import describe_figures
from megatron_lite.run_modes.plan.layouts import layout_flags, layout_overrides
from megatron_lite.run_modes.plan.report import RANKING
from megatron_lite.run_modes.preflight_json import RESERVE_FRACTION
from megatron_lite.training.memory.picture import prediction_parts
from megatron_lite.utils.atomic_io import atomic_write_bytes


def candidate_record(candidate, gpus: int, rank: int | None = None) -> dict:
    """One layout: its sizes and levers, flags and overrides, per stage the predicted peak and its
    parts (and the dry run's peak), the ranking figures, and whether it fits."""
    moe = bool(candidate.config.model.num_moe_experts)
    stages = []
    for i, p in enumerate(candidate.predictions):
        stage = {"stage": i, "predicted_max_allocated_bytes": p.peak_bytes}
        stage.update({f"{k}_bytes": v for k, v in prediction_parts(p).items()})
        if candidate.dry:
            stage["dry_run_max_allocated_bytes"] = candidate.dry[i].max_allocated_bytes
            stage["dry_run_difference"] = round(stage_differences(candidate)[i], 5)
        stages.append(stage)
    f = candidate.figures
    return {
        **({} if rank is None else {"rank": rank}),
        "layout": dataclasses.asdict(candidate.layout),
        "fits": candidate.fit,
        "flags": layout_flags(candidate.layout, gpus, moe),
        "overrides": layout_overrides(candidate.layout, moe),
        "stages": stages,
        "bubble_fraction": f.bubble,
        "recompute_flops_fraction": f.recompute,
        "comm_bytes_per_gpu_per_step": {k: round(v) for k, v in f.comm_bytes.items()},
        "inter_node_bytes_per_gpu_per_step": round(f.inter_node_bytes),
    }


def plan_record(plan) -> dict:
    """The whole plan (a planner.Plan) as data."""
    result, gpus = plan.result, plan.gpus
    given = plan.given
    return {
        "gpus": gpus,
        "device_bytes": int(plan.capacity_gb * 1e9),
        "reserve_fraction": RESERVE_FRACTION,
        "ranking": RANKING,
        "search_seconds": round(result.seconds, 3),
        "search_cpu_seconds": round(result.cpu_seconds, 3),
        "dry_run_seconds": round(plan.dry_seconds, 3),
        "counts": {
            "splits": result.grids,
            "predicted": result.predicted,
            "fit": len(result.fitting),
            "do_not_fit": len(result.rejected),
            "pruned": result.pruned,
            "refused": sum(result.refused.values()),
        },
        "listed": [candidate_record(c, gpus, i + 1) for i, c in enumerate(plan.listed)],
        "dropped_by_dry_run": [candidate_record(c, gpus) for c in plan.dropped],
        "given": given if isinstance(given, str) or given is None else candidate_record(given, gpus),
        "fits": bool(plan.listed),
    }


def write_json(path: str, plan) -> None:
    text = (json.dumps(plan_record(plan), indent=2) + "\n").encode()
    atomic_write_bytes(path, lambda f: f.write(text), needed=len(text))


def write_html(path: str, plan, title: str) -> None:
    """One MemoryPanel per listed layout (and the job's own layout, last, when it does not fit)."""
    from megatron_lite.training.memory.picture import (
        MemoryPanel,
        stage_bars_from_predictions,
        write_memory_page,
    )

    capacity = int(plan.capacity_gb * 1e9)
    panels = []
    for i, c in enumerate(plan.listed):
        lines = (
            c.layout.levers(),
            describe_figures(c.figures),
            " ".join(layout_flags(c.layout, plan.gpus, bool(c.config.model.num_moe_experts))),
        )
        bars = stage_bars_from_predictions(c.predictions, c.dry)
        panels.append(MemoryPanel(f"#{i + 1} {c.layout.sizes()}", bars, capacity, RESERVE_FRACTION, lines))
    given = plan.given
    if given is not None and not isinstance(given, str) and not given.fit:
        bars = stage_bars_from_predictions(given.predictions)
        head = f"own layout: {given.layout.sizes()} (does not fit)"
        lines = (plan.given_label, given.layout.levers(), describe_figures(given.figures))
        panels.append(MemoryPanel(head, bars, capacity, RESERVE_FRACTION, lines))
    notes = (RANKING, f"search {plan.result.seconds:.1f} s, dry runs {plan.dry_seconds:.1f} s")
    write_memory_page(path, title, panels, notes)
