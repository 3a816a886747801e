"""The preflight's dry run: each pipeline stage's real code, run at full scale on fake tensors, its
allocated peak measured.

    python pretrain.py <flags> --memory-preflight --device-memory-gb 80 --memory-dry-run

For each pipeline stage a forked process joins a fake world of the job's size (``torch.distributed``'s
``fake`` backend: every collective and point-to-point call returns at once, moving nothing) as the
rank of that stage at tensor-, context- and data-parallel rank 0, and under ``FakeTensorMode`` (tensors
with a shape, dtype and device but no storage) runs what a worker runs: ``initialize_megatron``,
``build_model_and_optimizer`` (the model chunks, DDP's gradient buffers, the optimizer, the distributed
optimizer's shards), the optimizer's first step (which allocates its state) and then ``train_step``,
the stage's own schedule included (1F1B or interleaved; a received activation or gradient is the fake
buffer the schedule allocates for it): the real run's second iteration, the first with the optimizer
state resident. The peak is the allocated-bytes tracker's (allocated.py), counting fake storages as
it counts the CPU's in a real run: the dry run and ``mem-max-allocated`` are one accounting, within
0.2% of each other on most stages of the layouts bench/memory_prediction.py runs and 1.5% on all
(a tp 2 first stage misses one t h e buffer of the real run's).

Where code differs by device the dry run takes the job's path: for a GPU job (``device_type="cuda"``,
the preflight's) NCCL's reduce-scatter, the foreach AdamW and attention with dropout as CUDA's fused
kernels run it, saving no probabilities (``cuda_attention_kernels``); for a CPU one gloo's. Point-to-point
sends complete with their exchange, as NCCL's and the shared-memory channel's do (gloo's sockets,
between hosts, hold each send until the next exchange: one output more for a while). The kernels
themselves are otherwise the CPU's (PyTorch's CPU flash attention saves what CUDA's fused kernels do). It drives the fewest microbatches that reach every stage's most in flight
(:func:`dry_run_microbatches`): a few instead of hundreds, the peak unchanged.

Why rank 0 of each group is enough: tensor-parallel ranks hold the same shapes (layers, heads and the
padded vocabulary split evenly), context-parallel ranks the same tokens per rank, and data-parallel
ranks differ only in the distributed optimizer's shard, by a few elements of bucket padding.
Stages with the same layers, no embedding and no output layer, and the same microbatches in flight
run the same code on the same shapes: one of them is measured for all. (In 1F1B stage i holds
min(pp - i, m) microbatches in flight, so middle stages i < j are twins only where m <= pp - j.)

The batch is fake too: the loader's keys, dtypes and shapes (token, label and position ids, the loss
mask, the attention mask where the dataset makes one), made when the step reads it, as the loader does.
The gradient norm, which a real step reads as a number, reads as 1.0 (clip_grads.py). Not simulated:
what no tensor shows (:data:`NOT_SIMULATED`).

A MoE model's routing is data too: its layers route as a plan says (dry_run/moe.py), and every op
from the router's gating to the combine runs at the sizes that routing gives. With
--moe-pad-expert-input-to-capacity the plan is the run's own routing; otherwise each stage is measured
twice, as the preflight judges it: under the worst routing its local experts can receive
(``max_allocated_bytes``, a bound) and under balanced routing (``balanced_max_allocated_bytes``, beside).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from megatron_lite.run_modes.dry_run.microbatches import (
    dry_run_microbatches,
    most_in_flight,
    stage_signature,
    with_microbatches,
)
from megatron_lite.run_modes.dry_run.moe import moe_layer_signature, moe_routings
from megatron_lite.run_modes.dry_run.processes import DryRunError, run_in_children
from megatron_lite.run_modes.dry_run.stage import measure_stage

__all__ = [
    "NOT_SIMULATED",
    "DryRunError",
    "StageDryRun",
    "dry_run_microbatches",
    "dry_run_stages",
    "measure_stage",
]

NOT_SIMULATED = (
    "not simulated (no tensor shows them): the CUDA context and kernels, NCCL's buffers, the caching "
    "allocator's rounding and fragmentation, scratch a kernel allocates inside itself"
)


@dataclass(frozen=True)
class StageDryRun:
    """One stage's dry run: what its TP / CP / DP rank 0 allocates over the optimizer's first step and
    one training step (a real run's first two iterations)."""

    pp_rank: int
    max_allocated_bytes: int
    """The allocated peak since start, temporaries included (``mem-max-allocated-bytes``)."""
    static_bytes: int
    """Weights, gradient buffers and optimizer state at the peak."""
    seconds: float
    """Time the measurement took (0 for a stage measured as another's twin)."""
    measured_as: int
    """The stage whose run gave these numbers (itself, or an identical stage's)."""
    balanced_max_allocated_bytes: int | None = None
    """A MoE model without padding to capacity, whose figures above are the worst routing's (a bound):
    the allocated peak under balanced routing; None otherwise."""


def dry_run_stages(config, device_type: str = "cpu", out=None, what: str = "the job") -> list[StageDryRun]:
    """Every pipeline stage's dry run for ``config`` (a validated ConfigContainer), identical stages
    measured once, each in a process of its own, as many at once as there are CPUs; this process
    builds no world. ``out``: a stream for what is run, one line per stage measured, the time taken
    and what is not simulated (``what`` names the job there). DryRunError when a stage fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    with FakeTensorMode():  # its first use imports torch._dynamo: once here, not in every child
        torch.empty(1) + 1
    count = dry_run_microbatches(config)
    if out is not None:
        print(
            f" dry run of {what}: each stage's real code on fake tensors in a fake world of {config.world_size} "
            f"ranks, {count} of {config.num_microbatches} microbatches (the rest repeat the steady state)",
            file=out,
            flush=True,
        )
    config = with_microbatches(config, count)
    pp = config.model.pipeline_model_parallel_size
    in_flight = most_in_flight(config, config.num_microbatches)
    signatures = [
        (stage_signature(config, stage, in_flight[stage]), moe_layer_signature(config.model, stage))
        for stage in range(pp)
    ]
    first_of: dict[tuple, int] = {}  # signature -> the stage measured for it
    for stage, signature in enumerate(signatures):
        first_of.setdefault(signature, stage)
    todo = sorted(set(first_of.values()))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    routings = moe_routings(config.model)
    runs = {}  # (stage, routing) -> (peak, static, seconds)
    workers = min(len(todo) * len(routings), cpus or 1)
    for (stage, routing), result in run_in_children(config, todo, device_type, workers, routings):
        runs[stage, routing] = result
        if out is not None:
            how = f" ({routing} routing)" if routing else ""
            print(f"   dry run: stage {stage}{how} measured in {result[2]:.1f} s", file=out, flush=True)
    results = {}
    for stage in todo:
        peak, static, seconds = runs[stage, routings[-1]]  # the judged one: the worst routing where open
        balanced = runs[stage, "balanced"] if len(routings) > 1 else None
        seconds += balanced[2] if balanced else 0.0
        results[stage] = StageDryRun(stage, peak, static, seconds, stage, balanced[0] if balanced else None)
    stages = [
        dataclasses.replace(results[first_of[signature]], pp_rank=stage, seconds=0.0)
        if first_of[signature] != stage
        else results[stage]
        for stage, signature in enumerate(signatures)
    ]
    if out is not None:
        seconds = time.perf_counter() - start
        print(f" dry run took {seconds:.1f} s ({len(todo)} stages measured); {NOT_SIMULATED}", file=out)
        if len(routings) > 1:
            both = ", ".join(
                f"stage {s.pp_rank} {s.max_allocated_bytes / 1e9:.3g} / {s.balanced_max_allocated_bytes / 1e9:.3g}"
                for s in stages
            )
            print(f" dry run's allocated peak (GB, worst routing / balanced routing): {both}", file=out)
    return stages
