"""This process's memory, measured: the report the loop logs and the console line.

``report_memory`` reads the allocator's statistics (``torch.cuda.memory_stats()``) on CUDA, the
operating system's resident set without it, plus the saved-tensor, optimizer-state and attribution
figures; it turns byte counts into gigabytes ("bytes" -> "gigabytes" in the name, the tables in
:mod:`.keys`) and the loop logs each entry as ``memory/<name>``. Reducing the report across the
pipeline is :mod:`.pipeline`'s.
"""

from __future__ import annotations

import math
import resource
import sys

import torch

from megatron_lite.training.memory.allocated import ALLOCATED_MEMORY
from megatron_lite.training.memory.attribution import MODEL_MEMORY, other_memory_stats
from megatron_lite.training.memory.keys import (
    ACTIVATION_MEMORY_KEYS,
    ATTRIBUTION_MEMORY_KEYS,
    CUDA_EXTRA_MEMORY_KEYS,
    HOST_MEMORY_KEYS,
    MEMORY_KEYS,
    OPTIMIZER_MEMORY_KEYS,
)
from megatron_lite.training.memory.saved_tensors import ACTIVATION_MEMORY


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
    """The tracker's peak since start once any step was tracked; its current bytes only when the latest
    step was (an untracked step's would be stale)."""
    if not ACTIVATION_MEMORY.tracked_once:
        return {}
    current = (
        {"activation_bytes.current": ACTIVATION_MEMORY.current_bytes} if ACTIVATION_MEMORY.tracking else {}
    )
    return {**current, "activation_bytes.peak": ACTIVATION_MEMORY.peak_bytes}


def default_memory_keys() -> dict[str, str]:
    """What ``report_memory(None)`` logs: upstream's MEMORY_KEYS plus ``mem-ooms`` on CUDA, the
    ``mem-rss-*`` keys without CUDA, the ``mem-*activation*`` keys always,
    ``mem-optimizer-state-bytes`` once an optimizer is tracked and the attribution keys
    (``mem-weights-bytes``, ``mem-grads-bytes``, ``mem-other-bytes``, ``mem-max-other-bytes``,
    ``mem-temporaries-bytes``) once the
    model is tracked too."""
    device_keys = {**MEMORY_KEYS, **CUDA_EXTRA_MEMORY_KEYS} if _cuda_in_use() else HOST_MEMORY_KEYS
    return {**device_keys, **ACTIVATION_MEMORY_KEYS, **OPTIMIZER_MEMORY_KEYS, **ATTRIBUTION_MEMORY_KEYS}


def gigabytes(num_bytes: float) -> float:
    """Bytes as gigabytes (1e9) rounded to 5 significant digits, as upstream rounds them."""
    value = num_bytes / 1.0e9
    if value == 0:
        return 0.0
    return round(value, 4 - int(math.floor(math.log10(abs(value)))))


def report_memory(memory_keys: dict[str, str] | None = None) -> dict:
    """This process's memory statistics, keyed by logged name.

    ``memory_keys`` maps a statistic's key to its logged name; empty or None means
    :func:`default_memory_keys`. Statistics come from ``torch.cuda.memory_stats()`` when CUDA is in
    use, otherwise from the allocated-bytes tracker (``allocated_bytes.all.*`` when the latest step
    was tracked) and the operating system (``rss_bytes.*``); the activation tracker's
    ``activation_bytes.*`` when the latest step was tracked. Keys that are not available are left out. A byte
    count (its key contains "bytes") becomes gigabytes with "bytes" replaced by "gigabytes" in the
    name; counters keep their integer value. Peaks are since the start of the run.
    """
    stats = _cuda_memory_stats() if _cuda_in_use() else {**_host_memory_stats(), **ALLOCATED_MEMORY.stats()}
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
            report[name.replace("bytes", "gigabytes")] = gigabytes(stats[stat_key])
        else:
            report[name] = stats[stat_key]
    return report


def device_memory_capacity_gigabytes() -> float | None:
    """This rank's accelerator memory in GB (1e9), or None without CUDA: host memory is shared by all
    ranks on a machine, so it is no per-rank capacity."""
    if _cuda_in_use():
        return gigabytes(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return None


def format_memory_line(rank: int, iteration: int, memory_report: dict) -> str:
    """Megatron's console memory line for one rank."""
    parts = "".join(f" | {name}: {value}" for name, value in memory_report.items())
    return f"[Rank {rank}] (after {iteration} iterations) memory (GB){parts}"
