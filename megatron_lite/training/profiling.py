"""The training loop's profiler hooks, with Megatron-Bridge's names and schedule.

With ``--profile --use-pytorch-profiler`` each profiled rank records iterations
``profile_step_start`` .. ``profile_step_end`` with ``torch.profiler`` and writes one Chrome trace,
``<tensorboard_dir>/../torch_profile/rank-<rank>.json.gz`` (Perfetto and chrome://tracing open it),
atomically; without a TensorBoard directory, ``./torch_profile`` (where upstream's path lands). ``--profile`` alone is Nsight Systems (CUDA's profiler API), as upstream.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.profiler

TNvtxContext = torch.autograd.profiler.emit_nvtx


def should_profile_rank(config, rank: int) -> bool:
    """Whether ``rank`` records: every rank when ``profile_ranks`` is empty, else those listed."""
    if config is None:
        return False
    return len(config.profile_ranks) == 0 or rank in config.profile_ranks


def trace_path(tensorboard_dir: str | None, rank: int) -> Path:
    """Where ``rank``'s Chrome trace goes: beside the TensorBoard directory, as upstream, or in the
    working directory without one."""
    beside = Path(tensorboard_dir).parent if tensorboard_dir else Path(".")
    return beside / "torch_profile" / f"rank-{rank}.json.gz"


def initialize_pytorch_profiler(config, tensorboard_dir: str | None) -> torch.profiler.profile:
    """A torch profiler (not started) that waits until ``profile_step_start``, warms up one step,
    records up to ``profile_step_end`` and then writes this rank's trace."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    path = trace_path(tensorboard_dir, rank)

    def trace_handler(prof: torch.profiler.profile) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written under a temporary name (ending .gz, so torch compresses it) and renamed: a reader
        # never sees half a trace.
        partial = path.with_name(f".{path.name[: -len('.json.gz')]}.partial.json.gz")
        prof.export_chrome_trace(str(partial))
        os.replace(partial, path)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(
            wait=max(config.profile_step_start - 1, 0),
            warmup=1 if config.profile_step_start > 0 else 0,
            active=config.profile_step_end - config.profile_step_start,
            repeat=1,
        ),
        on_trace_ready=trace_handler,
        record_shapes=config.pytorch_profiler_collect_shapes,
        with_stack=config.pytorch_profiler_collect_callstack,
    )


def handle_profiling_step(config, iteration: int, rank: int, pytorch_prof) -> TNvtxContext | None:
    """At the top of each iteration: advance the torch profiler's schedule, or start Nsight Systems
    at ``profile_step_start``. Returns the NVTX context when Nsight Systems started."""
    if config is None or not should_profile_rank(config, rank):
        return None
    if config.use_pytorch_profiler and pytorch_prof is not None:
        pytorch_prof.step()
    if config.use_nsys_profiler and iteration == config.profile_step_start:
        return start_nsys_profiler(config)
    return None


def handle_profiling_stop(config, iteration: int, rank: int, pytorch_prof, nsys_nvtx_context=None) -> None:
    """After the iteration that reaches ``profile_step_end``: stop the profiler (the trace is written)."""
    if config is None or not should_profile_rank(config, rank) or iteration != config.profile_step_end:
        return
    if config.use_pytorch_profiler and pytorch_prof is not None:
        pytorch_prof.stop()
    if config.use_nsys_profiler:
        stop_nsys_profiler(nsys_nvtx_context)


def start_nsys_profiler(config) -> TNvtxContext:
    """Start CUDA's profiler (Nsight Systems records from here) with NVTX ranges per op."""
    torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
    context = torch.autograd.profiler.emit_nvtx(record_shapes=config.record_shapes)
    context.__enter__()
    return context


def stop_nsys_profiler(nvtx_context: TNvtxContext | None) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
    if nvtx_context is not None:
        nvtx_context.__exit__(None, None, None)
