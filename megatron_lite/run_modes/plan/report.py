"""The plan in words: what was searched, pruned and ranked and how, each listed layout with its peaks,
dry run, figures and the flags or overrides to run it, why the first beats the next, and where the
job's own layout stands."""

from __future__ import annotations

from megatron_lite.run_modes.dry_run import NOT_SIMULATED
from megatron_lite.run_modes.plan.confirm import AGREEMENT, agrees, stage_differences
from megatron_lite.run_modes.plan.figures import describe_figures
from megatron_lite.run_modes.plan.layouts import GPUS_PER_NODE
from megatron_lite.run_modes.preflight_json import RESERVE_FRACTION, usable_gb
from megatron_lite.training.memory.picture import prediction_parts

PRUNED = (
    "not searched: sequence parallelism off at tp > 1 (never less memory; it repeats the norms and dropout on "
    "every TP rank) and the distributed optimizer off (never less memory, and more bytes: an fp32 all-reduce "
    f"where it reduce-scatters fp32 and all-gathers bf16); tp above a node ({GPUS_PER_NODE} GPUs). Pruned per "
    "(tp, pp, vp, cp, ep): the lever sets costlier than the first that fits (same bubble, more FLOPs, no fewer "
    "bytes) and, when the leanest (every layer recomputed, the fused loss) does not fit, all of them"
)
RANKING = (
    "ranking (NOT a measured time): first the pipeline bubble plus recompute's extra FLOPs, in whole percent "
    "(closer is a tie); then the bytes each GPU sends and receives per step in groups that span nodes; then "
    f"all its bytes (TP's stay inside a node of {GPUS_PER_NODE}). Overlap, bandwidths and kernel speeds are not modelled"
)


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.4g}"


def stage_line(candidate) -> str:
    """'0: 71.78 / 71.80 (+0.0%), 1: ...' (predicted / dry run) or '0: 71.78, 1: ...' (predicted)."""
    if candidate.dry is None:
        return ", ".join(f"{p.pp_rank}: {_gb(p.peak_bytes)}" for p in candidate.predictions)
    diffs = stage_differences(candidate)
    return ", ".join(
        f"{p.pp_rank}: {_gb(p.peak_bytes)} / {_gb(d.max_allocated_bytes)} ({x:+.1%})"
        for p, d, x in zip(candidate.predictions, candidate.dry, diffs)
    )


def how_to_run(candidate, gpus: int, recipe: str | None, moe: bool) -> str:
    """The flags (flag-set plans) or the recipe overrides to run ``candidate``."""
    from megatron_lite.run_modes.plan.layouts import layout_flags, layout_overrides

    if recipe is None:
        return "flags (with the job's others): " + " ".join(layout_flags(candidate.layout, gpus, moe))
    return f"recipe {recipe} on {gpus} GPUs with: " + " ".join(layout_overrides(candidate.layout, moe))


def print_candidate(rank: int, candidate, gpus: int, recipe: str | None, out) -> None:
    """One listed layout: its description, peaks (and dry run), figures and how to run it."""
    moe = bool(candidate.config.model.num_moe_experts)
    print(f" #{rank} {candidate.layout.describe()}", file=out)
    if candidate.dry is None:
        print(f"    peak per stage, GB (predicted): {stage_line(candidate)}", file=out)
    else:
        verdict = "the dry run confirms it" if candidate.fit else "the dry run does NOT fit"
        within = (
            f"within {AGREEMENT:.0%} on every stage" if agrees(candidate) else f"NOT within {AGREEMENT:.0%}"
        )
        print(
            f"    peak per stage, GB (predicted / dry run): {stage_line(candidate)}; {verdict}, {within}",
            file=out,
        )
    print(f"    {describe_figures(candidate.figures)}", file=out)
    print(f"    {how_to_run(candidate, gpus, recipe, moe)}", file=out)


def _apart(x: float, y: float) -> tuple[str, str]:
    """Two byte counts in GB with as many digits as it takes to tell them apart (up to 7)."""
    for digits in range(3, 8):
        a, b = f"{x / 1e9:.{digits}g}", f"{y / 1e9:.{digits}g}"
        if a != b:
            break
    return a, b


def why_first(listed: list, capacity_gb: float) -> list[str]:
    """A few lines: why #1 ranks above #2, and what #1 gives up."""
    if not listed:
        return []
    first = listed[0]
    f1 = first.figures
    lines = []
    if len(listed) > 1:
        f2 = listed[1].figures
        if round(f1.overhead * 100) < round(f2.overhead * 100):
            lines.append(
                f"why #1 over #2: less bubble and recompute ({f1.overhead:.1%} of the step against {f2.overhead:.1%})"
            )
        elif round(f1.inter_node_bytes / 1e6) < round(f2.inter_node_bytes / 1e6):
            a, b = _apart(f1.inter_node_bytes, f2.inter_node_bytes)
            lines.append(
                "why #1 over #2: the same bubble and recompute to the percent, and fewer bytes across nodes per "
                f"GPU per step ({a} GB against {b} GB)"
            )
        else:
            a, b = _apart(f1.total_bytes, f2.total_bytes)
            lines.append(
                "why #1 over #2: the same bubble, recompute and bytes across nodes; fewer bytes in all "
                f"({a} GB against {b} GB)"
            )
    peak = max(first.peaks)
    gives = [f"headroom: its peak is {_gb(peak)} of {usable_gb(capacity_gb):g} GB usable"]
    if f1.bubble:
        gives.append(f"a {f1.bubble:.1%} bubble")
    if f1.recompute:
        gives.append(f"{f1.recompute:.1%} more FLOPs for recompute")
    lines.append("what #1 gives up: " + "; ".join(gives))
    return lines


def why_not_fit(candidate, capacity_gb: float) -> str:
    """Which stage runs out, its peak against the usable memory, and what dominates it."""
    peaks = candidate.peaks
    stage = max(range(len(peaks)), key=lambda i: peaks[i])
    parts = prediction_parts(candidate.predictions[stage])
    static = parts["weights"] + parts.get("adapters", 0) + parts["grads"] + parts["optimizer"]
    lay = candidate.layout
    shards = lay.dp * lay.cp if lay.distopt else 1
    return (
        f"stage {stage} runs out: {_gb(peaks[stage])} GB > {usable_gb(capacity_gb):g} GB usable; its static memory "
        f"alone is {_gb(static)} GB (weights {_gb(parts['weights'])}, grads {_gb(parts['grads'])}, optimizer "
        f"{_gb(parts['optimizer'])}: sharded over dp x cp = {shards}), activations {_gb(parts['activations'])} GB, "
        f"temporaries {_gb(parts['temporaries'])} GB"
    )


def given_lines(given, fitting: list, capacity_gb: float, what: str) -> list[str]:
    """Where the job's own layout stands: fits and its rank, or why not (and whether its split fits
    with other levers). ``given``: a Candidate, or a string saying why the validation refused it."""
    if isinstance(given, str):
        return [f"{what} ({given.splitlines()[0]}) is refused on this many GPUs"]
    head = f"{what}: {given.layout.describe()}"
    same = [c for c in fitting if c.layout.grid == given.layout.grid and c.layout != given.layout]
    if given.fit:
        better = sum(c.figures.rank_key() < given.figures.rank_key() for c in fitting)
        lines = [
            f"{head}: fits; it ranks {better + 1} of the {len(fitting)} layouts that fit (every variant counted)"
        ]
        if same and same[0].figures.rank_key() < given.figures.rank_key():
            rank = fitting.index(same[0]) + 1
            lines.append(f"  the same split ranks {rank} as {same[0].layout.describe()}")
        return lines
    lines = [f"{head}: does not fit; {why_not_fit(given, capacity_gb)}"]
    if same:
        rank = fitting.index(same[0]) + 1
        lines.append(
            f"  the same split fits as {same[0].layout.describe()} (rank {rank} of the {len(fitting)} that fit)"
        )
    else:
        lines.append(
            "  no lever set makes the same split fit (not even every layer recomputed and the fused loss)"
        )
    return lines


def header_lines(result, gpus: int, capacity_gb: float, what: str) -> list[str]:
    """What was searched and how many layouts fit, failed, were pruned or refused."""
    refused = sum(result.refused.values())
    reasons = "; ".join(f"{n} x '{r}'" for r, n in sorted(result.refused.items(), key=lambda kv: -kv[1])[:3])
    return [
        f"layout plan for {what} on {gpus} GPUs of {capacity_gb:g} GB ({usable_gb(capacity_gb):g} GB usable per "
        f"GPU: {RESERVE_FRACTION:.0%} kept for the CUDA context, NCCL's buffers and the allocator)",
        f"searched {result.grids} splits (tp, pp, vp, cp, ep) with their levers in {result.seconds:.1f} s "
        f"({result.cpu_seconds:.1f} s of CPU): "
        f"{result.predicted} predicted, {len(result.fitting)} fit, {len(result.rejected)} do not fit, "
        f"{result.pruned} pruned, {refused} refused by the validation" + (f" ({reasons})" if reasons else ""),
        PRUNED,
        RANKING,
    ]


def dry_run_note() -> str:
    return f"the dry run: each stage's real code at full size on fake tensors; {NOT_SIMULATED}"
