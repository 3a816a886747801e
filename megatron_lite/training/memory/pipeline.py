"""The memory report across the pipeline: the collectives and the step's ``memory/*`` metrics.

Only the last rank writes, while the peak usually lives on the first stage, so every pipeline rank
reduces its report over the pipeline group before the writer logs it. :func:`memory_metrics` is the one
code path the loop (and training_log, when not given a report) takes.

Which stage holds the peak is learnt in the same collective that reduces the report: the default path
reduces every memory key with one MAX all-reduce over the pipeline group
(``reduce_max_memory_across_pp_group``), which loses who held the maximum. Each stage therefore adds
one slot per stage to its report, its own headline value in its own slot and zero in the others: after
the MAX every rank has every stage's headline, at the cost of ``pp`` more float64s in the same call.
"""

from __future__ import annotations

import torch
import torch.distributed

from megatron_lite.core.utils import get_collective_device
from megatron_lite.training.memory.report import device_memory_capacity_gigabytes, report_memory
from megatron_lite.utils.common_utils import print_rank_last

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


def _pack(memory_report: dict, device: torch.device) -> torch.Tensor:
    return torch.tensor([float(v) for v in memory_report.values()], dtype=torch.float64, device=device)


def _unpack(memory_report: dict, values) -> dict:
    """Values in the report's key order; ints (not bools) come back as ints."""
    out = {}
    for (key, original), value in zip(memory_report.items(), values):
        out[key] = (
            int(value) if isinstance(original, int) and not isinstance(original, bool) else float(value)
        )
    return out


def _group_size(group) -> int:
    size = getattr(group, "size", None)
    return size() if callable(size) else 0


def reduce_max_memory_across_pp_group(memory_report: dict, pp_group) -> dict:
    """Per-key maximum of ``memory_report`` over the pipeline stages.

    Collective: call on every rank of ``pp_group`` with the same keys in the same order (report_memory
    guarantees that), never behind a rank check. One float64 MAX all-reduce of all values. Returns
    the input unchanged when the report is empty, torch.distributed is unavailable or uninitialized,
    or the group has no callable ``size`` or a size <= 1; otherwise a new dict. The input is never
    mutated.
    """
    if not memory_report or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return memory_report
    if _group_size(pp_group) <= 1:
        return memory_report
    values = _pack(memory_report, get_collective_device(pp_group))
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=pp_group)
    return _unpack(memory_report, values.tolist())


def gather_memory_across_pp_group(memory_report: dict, pp_group) -> tuple[dict, list[dict]]:
    """Every stage's report and their per-key maximum: ``(max_report, [stage_0_report, ...])``.

    Collective over ``pp_group`` (one all-gather), under the same rules as
    :func:`reduce_max_memory_across_pp_group`; without a group to gather over, this rank's report is
    the only stage.
    """
    if (
        not memory_report
        or not torch.distributed.is_available()
        or not torch.distributed.is_initialized()
        or _group_size(pp_group) <= 1
    ):
        return memory_report, [memory_report]
    local = _pack(memory_report, get_collective_device(pp_group))
    gathered = [torch.empty_like(local) for _ in range(_group_size(pp_group))]
    torch.distributed.all_gather(gathered, local, group=pp_group)
    stages = [_unpack(memory_report, t.tolist()) for t in gathered]
    peak = _unpack(memory_report, torch.stack(gathered).max(dim=0).values.tolist())
    return peak, stages


# Per expert-parallel rank, the values that differ by routing (the bench reads them per stage).
EP_SLOT_NAMES = ("mem-max-allocated-gigabytes", "mem-max-activation-gigabytes")


def reduce_max_memory_across_ep_group(memory_report: dict, ep_group) -> dict:
    """Per-key maximum of ``memory_report`` over the expert-parallel ranks of this stage (which differ
    by the tokens routed to their experts), plus each EP rank's own ``ep-rank-<r>/<name>`` for the
    names in EP_SLOT_NAMES. Collective over ``ep_group`` (one all-gather) on every rank, before the
    pipeline reduction; the report unchanged without a group of more than one rank."""
    if (
        not memory_report
        or not torch.distributed.is_available()
        or not torch.distributed.is_initialized()
        or _group_size(ep_group) <= 1
    ):
        return memory_report
    local = _pack(memory_report, get_collective_device(ep_group))
    gathered = [torch.empty_like(local) for _ in range(_group_size(ep_group))]
    torch.distributed.all_gather(gathered, local, group=ep_group)
    peak = _unpack(memory_report, torch.stack(gathered).max(dim=0).values.tolist())
    for rank, values in enumerate(gathered):
        rank_report = _unpack(memory_report, values.tolist())
        peak.update({f"ep-rank-{rank}/{n}": rank_report[n] for n in EP_SLOT_NAMES if n in rank_report})
    return peak


def memory_metrics(
    lg,
    iteration: int,
    pp_group,
    *,
    per_stage: bool | None = None,
    report_fn=None,
    reduce_fn=None,
    ep_group=None,
) -> dict[str, float] | None:
    """This step's ``memory/*`` metrics: every key's max over the pipeline stages, which stage holds the
    headline peak (``memory/peak-stage``) and the spread (``memory/pp-imbalance``), and with
    --log-memory-per-pp-stage each stage's own value; None when memory is not logged this step.
    Collective over ``pp_group``: every PP rank calls it, before training_log's writer-gated block.
    Exactly one collective: the all-gather, or the MAX all-reduce with one headline slot per stage.

    ``per_stage`` overrides ``lg.log_memory_per_pp_stage`` (training_log's fallback logs the max only,
    as upstream's); ``report_fn`` and ``reduce_fn`` replace :func:`report_memory` and
    :func:`reduce_max_memory_across_pp_group` (training_log passes the names it looks up, so code
    written against upstream can patch them on train_utils). ``ep_group`` (a MoE model's expert-parallel
    group): each stage's report is first its worst EP rank's (:func:`reduce_max_memory_across_ep_group`,
    one more collective, on every rank), with each EP rank's peaks beside it."""
    if not (lg.log_memory_to_tensorboard and iteration % lg.tensorboard_log_interval == 0):
        return None
    report_fn = report_fn or report_memory
    reduce_fn = reduce_fn or reduce_max_memory_across_pp_group
    per_stage = lg.log_memory_per_pp_stage if per_stage is None else per_stage
    local_report = reduce_max_memory_across_ep_group(report_fn(lg.memory_keys), ep_group)
    metrics: dict[str, float] = {}
    num_stages = max(_group_size(pp_group), 1)
    if per_stage:
        peak, stages = gather_memory_across_pp_group(local_report, pp_group)
        for stage, stage_report in enumerate(stages):
            metrics.update({f"memory/pp-stage-{stage}/{k}": v for k, v in stage_report.items()})
        name = headline_name(local_report)
        stage_values = [s[name] for s in stages] if name else None
    else:
        slotted = with_stage_slots(
            local_report, torch.distributed.get_rank(pp_group) if num_stages > 1 else 0, num_stages
        )
        peak, stage_values = split_stage_slots(reduce_fn(slotted, pp_group), num_stages)
    metrics.update({f"memory/{k}": v for k, v in peak.items()})
    if stage_values:
        metrics.update(peak_stage_metrics(stage_values))
    if (capacity := device_memory_capacity_gigabytes()) is not None:
        metrics["memory/capacity-gigabytes"] = capacity
    if (retries := peak.get("mem-alloc-retries-delta", 0)) > 0:
        print_rank_last(
            f" memory: the CUDA caching allocator retried {retries} allocations since the last log (it had"
            " to free its cache to find memory: fragmented or close to OOM); consider"
            " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or more recomputation"
        )
    return metrics
