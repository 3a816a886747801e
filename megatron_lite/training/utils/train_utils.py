"""Memory reports and their reduction across the pipeline (so the writer rank logs the true peak),
plus the loop's small collective helpers."""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed
import torch.distributed as dist

from megatron_lite.core.utils import get_collective_device
from megatron_lite.training.utils.activation_memory import ACTIVATION_MEMORY

# torch.cuda.memory_stats() key -> logged name.
MEMORY_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
    "active_bytes.all.current": "mem-active-bytes",
    "active_bytes.all.peak": "mem-max-active-bytes",
    "inactive_split_bytes.all.current": "mem-inactive-split-bytes",
    "inactive_split_bytes.all.peak": "mem-max-inactive-split-bytes",
    "reserved_bytes.all.current": "mem-reserved-bytes",
    "reserved_bytes.all.peak": "mem-max-reserved-bytes",
    "num_alloc_retries": "mem-alloc-retries",
    "num_ooms": "mem-ooms",
    "allocation.all.current": "mem-allocation-count",
}

# Host (no CUDA) statistics, same conventions: the process's resident memory from the OS.
HOST_MEMORY_KEYS: dict[str, str] = {
    "rss_bytes.current": "mem-rss-bytes",
    "rss_bytes.peak": "mem-max-rss-bytes",
}

# Saved-for-backward tensors, measured on CPU and CUDA alike.
ACTIVATION_MEMORY_KEYS: dict[str, str] = {
    "activation_bytes.current": "mem-activation-bytes",
    "activation_bytes.peak": "mem-max-activation-bytes",
}


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
    return {
        "activation_bytes.current": ACTIVATION_MEMORY.current_bytes,
        "activation_bytes.peak": ACTIVATION_MEMORY.peak_bytes,
    }


def report_memory(memory_keys: dict[str, str] | None = None) -> dict:
    """This process's memory statistics, keyed by logged name.

    On CUDA: ``torch.cuda.memory_stats()`` through ``memory_keys`` (default MEMORY_KEYS). Without
    CUDA: the process's current and peak resident memory from the operating system (``mem-rss-*``).
    Always: current and peak bytes of activations saved for backward (``mem-*activation*``), measured
    by the ActivationMemoryTracker. Peaks are since the start of the run. Byte counts become
    gigabytes (1e9) rounded to 5 significant digits, with "bytes" in the name replaced by
    "gigabytes"; counters stay int.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats, defaults = torch.cuda.memory_stats(), MEMORY_KEYS
    else:
        stats, defaults = _host_memory_stats(), HOST_MEMORY_KEYS
    stats.update(_activation_memory_stats())
    keys = memory_keys if memory_keys is not None else {**defaults, **ACTIVATION_MEMORY_KEYS}
    report: dict = {}
    for stat_key, name in keys.items():
        if stat_key not in stats:
            continue
        value = stats[stat_key]
        if "bytes" in name:
            report[name.replace("bytes", "gigabytes")] = float(f"{value / 1e9:.5g}")
        else:
            report[name] = int(value)
    return report


def device_memory_capacity_gigabytes() -> float | None:
    """This rank's accelerator memory in GB (1e9), or None without CUDA: host memory is shared by all
    ranks on a machine, so it is no per-rank capacity."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return float(f"{total / 1e9:.5g}")
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
    parts = " | ".join(f"{name}: {value}" for name, value in memory_report.items())
    return f"[Rank {rank}] (after {iteration} iterations) memory (GB) | {parts}"


def print_rank_last(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(message, flush=True)


def mean_over_dp(values: list[torch.Tensor], dp_group) -> list[float]:
    """Average scalars over the data-parallel group in one all-reduce. Collective over ``dp_group``."""
    if not values:
        return []
    stacked = torch.stack([v.detach().double().reshape(()) for v in values])
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(stacked, group=dp_group)
        stacked /= dist.get_world_size(dp_group)
    return stacked.tolist()
