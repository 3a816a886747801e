"""Memory reports and their reduction across the pipeline (so the writer rank logs the true peak).

Names follow upstream's ``train_utils``: ``MEMORY_KEYS`` maps ``torch.cuda.memory_stats()`` keys to
logged names, ``report_memory`` turns byte counts into gigabytes ("bytes" -> "gigabytes" in the
name) and the loop logs each entry as ``memory/<name>``. Our extras sit beside upstream's keys in
their own tables, so upstream's dashboards keep working and ours gain the extra panels.
"""

from __future__ import annotations

import math
import resource
import sys

import torch
import torch.distributed

from megatron_lite.core.utils import get_collective_device
from megatron_lite.training.utils.activation_memory import ACTIVATION_MEMORY
from megatron_lite.training.utils.memory_attribution import (
    ATTRIBUTION_MEMORY_KEYS,
    MODEL_MEMORY,
    other_memory_stats,
)

# torch.cuda.memory_stats() key -> logged name, exactly upstream's (order included).
MEMORY_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "active_bytes.all.current": "mem-active-bytes",
    "inactive_split_bytes.all.current": "mem-inactive-bytes",
    "reserved_bytes.all.current": "mem-reserved-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
    "active_bytes.all.peak": "mem-max-active-bytes",
    "inactive_split_bytes.all.peak": "mem-max-inactive-bytes",
    "reserved_bytes.all.peak": "mem-max-reserved-bytes",
    # Upstream's spelling ("retires"), kept so existing dashboards and alerts keep matching.
    "num_alloc_retries": "mem-alloc-retires",
    "allocation.all.current": "mem-allocated-count",
}

# Our CUDA extras (upstream logs none of them): out-of-memory errors the caching allocator has raised;
# its health: the share of reserved memory not allocated ((reserved - allocated) / reserved), and how
# many allocations it retried (freeing its cache to satisfy them) since the previous report.
CUDA_EXTRA_MEMORY_KEYS: dict[str, str] = {
    "num_ooms": "mem-ooms",
    "fragmentation.current": "mem-fragmentation",
    "num_alloc_retries.delta": "mem-alloc-retries-delta",
}

# Host (no CUDA) statistics, same conventions: the process's resident memory from the OS.
HOST_MEMORY_KEYS: dict[str, str] = {
    "rss_bytes.current": "mem-rss-bytes",
    "rss_bytes.peak": "mem-max-rss-bytes",
}

# Saved-for-backward tensors, measured on CPU and CUDA alike by the ActivationMemoryTracker.
ACTIVATION_MEMORY_KEYS: dict[str, str] = {
    "activation_bytes.current": "mem-activation-bytes",
    "activation_bytes.peak": "mem-max-activation-bytes",
}


# This rank's optimizer state (moments and fp32 master copies), measured from the optimizer's tensors;
# present once setup registers the optimizer, so the saving of --use-distributed-optimizer shows.
OPTIMIZER_MEMORY_KEYS: dict[str, str] = {"optimizer_state_bytes.current": "mem-optimizer-state-bytes"}


class OptimizerStateMemory:
    """Holds the run's optimizer so the memory report can measure its state bytes."""

    def __init__(self):
        self.optimizer = None

    def track(self, optimizer) -> None:
        self.optimizer = optimizer

    def stats(self) -> dict[str, int]:
        if self.optimizer is None:
            return {}
        return {"optimizer_state_bytes.current": self.optimizer.optimizer_state_bytes()}


OPTIMIZER_STATE_MEMORY = OptimizerStateMemory()


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


_previous_alloc_retries: list[int] = []  # the allocator's retry count at the previous report


def _cuda_memory_stats() -> dict:
    """torch.cuda.memory_stats() plus the allocator-health figures of CUDA_EXTRA_MEMORY_KEYS."""
    stats = dict(torch.cuda.memory_stats())
    reserved = stats.get("reserved_bytes.all.current", 0)
    allocated = stats.get("allocated_bytes.all.current", 0)
    stats["fragmentation.current"] = (reserved - allocated) / reserved if reserved else 0.0
    if "num_alloc_retries" in stats:
        retries = stats["num_alloc_retries"]
        # Never negative: a counter reset (torch.cuda.reset_peak_memory_stats) is no retry.
        stats["num_alloc_retries.delta"] = max(0, retries - (_previous_alloc_retries or [retries])[-1])
        _previous_alloc_retries[:] = [retries]
    return stats


def _host_memory_stats() -> dict[str, int]:
    """Current and peak resident set size in bytes (peak since the process started)."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return {
            "rss_bytes.current": int(fields["VmRSS"].split()[0]) * 1024,
            "rss_bytes.peak": int(fields["VmHWM"].split()[0]) * 1024,
        }
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
        return {"rss_bytes.current": peak, "rss_bytes.peak": peak}


def _activation_memory_stats() -> dict[str, int]:
    """The tracker's bytes, or nothing when the latest step ran untracked (its numbers would be stale)."""
    if not ACTIVATION_MEMORY.tracking:
        return {}
    return {
        "activation_bytes.current": ACTIVATION_MEMORY.current_bytes,
        "activation_bytes.peak": ACTIVATION_MEMORY.peak_bytes,
    }


def default_memory_keys() -> dict[str, str]:
    """What ``report_memory(None)`` logs: upstream's MEMORY_KEYS plus ``mem-ooms`` on CUDA, the
    ``mem-rss-*`` keys without CUDA, the ``mem-*activation*`` keys always,
    ``mem-optimizer-state-bytes`` once an optimizer is tracked and the attribution keys
    (``mem-weights-bytes``, ``mem-grads-bytes``, ``mem-other-bytes``, ``mem-max-other-bytes``) once the
    model is tracked too."""
    device_keys = {**MEMORY_KEYS, **CUDA_EXTRA_MEMORY_KEYS} if _cuda_in_use() else HOST_MEMORY_KEYS
    return {**device_keys, **ACTIVATION_MEMORY_KEYS, **OPTIMIZER_MEMORY_KEYS, **ATTRIBUTION_MEMORY_KEYS}


def _gigabytes(num_bytes: float) -> float:
    """Bytes as gigabytes (1e9) rounded to 5 significant digits, as upstream rounds them."""
    gigabytes = num_bytes / 1.0e9
    if gigabytes == 0:
        return 0.0
    return round(gigabytes, 4 - int(math.floor(math.log10(abs(gigabytes)))))


def report_memory(memory_keys: dict[str, str] | None = None) -> dict:
    """This process's memory statistics, keyed by logged name.

    ``memory_keys`` maps a statistic's key to its logged name; empty or None means
    :func:`default_memory_keys`. Statistics come from ``torch.cuda.memory_stats()`` when CUDA is in
    use, otherwise from the operating system (``rss_bytes.*``); the activation tracker's
    ``activation_bytes.*`` when the latest step was tracked. Keys that are not available are left out. A byte
    count (its key contains "bytes") becomes gigabytes with "bytes" replaced by "gigabytes" in the
    name; counters keep their integer value. Peaks are since the start of the run.
    """
    stats = _cuda_memory_stats() if _cuda_in_use() else _host_memory_stats()
    stats.update(_activation_memory_stats())
    stats.update(OPTIMIZER_STATE_MEMORY.stats())
    stats.update(MODEL_MEMORY.stats())
    stats.update(other_memory_stats(stats))
    keys = memory_keys if memory_keys else default_memory_keys()
    report: dict = {}
    for stat_key, name in keys.items():
        if stat_key not in stats:
            continue
        if "bytes" in stat_key:
            report[name.replace("bytes", "gigabytes")] = _gigabytes(stats[stat_key])
        else:
            report[name] = stats[stat_key]
    return report


def device_memory_capacity_gigabytes() -> float | None:
    """This rank's accelerator memory in GB (1e9), or None without CUDA: host memory is shared by all
    ranks on a machine, so it is no per-rank capacity."""
    if _cuda_in_use():
        return _gigabytes(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return None


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


def format_memory_line(rank: int, iteration: int, memory_report: dict) -> str:
    """Megatron's console memory line for one rank."""
    parts = "".join(f" | {name}: {value}" for name, value in memory_report.items())
    return f"[Rank {rank}] (after {iteration} iterations) memory (GB){parts}"
