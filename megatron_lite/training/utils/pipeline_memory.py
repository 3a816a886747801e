"""Which pipeline stage holds the memory peak, learnt in the same collective that reduces the report.

The default path reduces every memory key with one MAX all-reduce over the pipeline group
(``reduce_max_memory_across_pp_group``), which loses who held the maximum. Each stage therefore adds
one slot per stage to its report, its own headline value in its own slot and zero in the others: after
the MAX every rank has every stage's headline, at the cost of ``pp`` more float64s in the same call.
"""

from __future__ import annotations

# The headline peak, the first of these the report has: the allocator's on CUDA, the process's on the
# host, else the saved activations' (a custom --memory-keys selection may lack the first two).
HEADLINE_NAMES = ("mem-max-allocated-gigabytes", "mem-max-rss-gigabytes", "mem-max-activation-gigabytes")
_SLOT = "pp-stage-{}/headline"


def headline_name(report: dict) -> str | None:
    return next((name for name in HEADLINE_NAMES if name in report), None)


def with_stage_slots(report: dict, stage: int, num_stages: int) -> dict:
    """``report`` plus one slot per stage: this stage's headline value in its own slot, 0 elsewhere."""
    name = headline_name(report)
    if name is None or num_stages <= 1:
        return report
    slots = {_SLOT.format(s): float(report[name]) if s == stage else 0.0 for s in range(num_stages)}
    return {**report, **slots}


def split_stage_slots(reduced: dict, num_stages: int) -> tuple[dict, list[float] | None]:
    """The reduced report without the slots, and every stage's headline (None without slots)."""
    slots = [_SLOT.format(s) for s in range(num_stages)]
    if num_stages <= 1 or slots[0] not in reduced:
        return reduced, None
    values = [float(reduced[slot]) for slot in slots]
    return {k: v for k, v in reduced.items() if k not in slots}, values


def peak_stage_metrics(stage_values: list[float]) -> dict[str, float]:
    """``memory/peak-stage`` (the lowest stage holding the maximum) and ``memory/pp-imbalance``
    (max / min over stages; left out when a stage reports zero)."""
    peak = max(stage_values)
    metrics: dict[str, float] = {"memory/peak-stage": stage_values.index(peak)}
    if min(stage_values) > 0:
        metrics["memory/pp-imbalance"] = peak / min(stage_values)
    return metrics
