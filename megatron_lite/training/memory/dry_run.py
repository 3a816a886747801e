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
0.2% of each other on every stage of the layouts bench/memory_prediction.py runs.

Where code differs by device the dry run takes the job's path: for a GPU job (``device_type="cuda"``,
the preflight's) NCCL's reduce-scatter and the foreach AdamW; for a CPU one gloo's. The kernels
themselves are the CPU's (PyTorch's CPU flash attention, which saves what CUDA's does without
dropout). It drives the fewest microbatches that reach every stage's most in flight
(:func:`dry_run_microbatches`): a few instead of hundreds, the peak unchanged.

Why rank 0 of each group is enough: tensor-parallel ranks hold the same shapes (layers, heads and the
padded vocabulary split evenly), context-parallel ranks the same tokens per rank, and data-parallel
ranks differ only in the distributed optimizer's shard, by a few elements of bucket padding.
Stages with the same layers, no embedding and no output layer, and the same microbatches in flight
run the same code on the same shapes: one of them is measured for all. (In 1F1B stage i holds
min(pp - i, m) microbatches, so middle stages are twins only where m < pp - i.)

The batch is fake too: the loader's keys, dtypes and shapes (token, label and position ids, the loss
mask, the attention mask where the dataset makes one), made when the step reads it, as the loader does.
The gradient norm, which a real step reads as a number, reads as 1.0 (clip_grads.py). Not simulated:
what no tensor shows (:data:`NOT_SIMULATED`).
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import sys
import time
import warnings
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

NOT_SIMULATED = (
    "not simulated (no tensor shows them): the CUDA context and kernels, NCCL's buffers, the caching "
    "allocator's rounding and fragmentation, scratch a kernel allocates inside itself"
)


@dataclass(frozen=True)
class StageDryRun:
    """One stage's dry run: what its TP / CP / DP rank 0 allocates over two training steps."""

    pp_rank: int
    max_allocated_bytes: int
    """The allocated peak since start, temporaries included (``mem-max-allocated-bytes``)."""
    static_bytes: int
    """Weights, gradient buffers and optimizer state at the peak."""
    seconds: float
    """Time the measurement took (0 for a stage measured as another's twin)."""
    measured_as: int
    """The stage whose run gave these numbers (itself, or an identical stage's)."""


def most_in_flight(config, count: int) -> list[tuple[int, ...]]:
    """Per stage, per model chunk: the most microbatches holding activations at once over ``count``
    microbatches (the schedule's own count, ``in_flight_microbatch_chunks``)."""
    from megatron_lite.core.pipeline_parallel.interleaved import in_flight_microbatch_chunks

    m = config.model
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    group = m.microbatch_group_size_per_vp_stage or pp
    timelines = [in_flight_microbatch_chunks(count, vp, pp, rank, group) for rank in range(pp)]
    return [tuple(max((step[c] for step in t), default=0) for c in range(vp)) for t in timelines]


def _stage_signature(config, rank: int, in_flight: tuple[int, ...]) -> tuple:
    """What decides a stage's memory: its chunks' layer counts and ends, and microbatches in flight."""
    from megatron_lite.core.transformer.transformer_block import get_num_layers_to_build
    from megatron_lite.training.memory.predict.params import chunk_bounds

    m = config.model
    chunks = tuple(
        (get_num_layers_to_build(m, vp_stage, rank), *chunk_bounds(m, rank, vp_stage))
        for vp_stage in range(m.virtual_pipeline_model_parallel_size or 1)
    )
    return chunks, in_flight


def _fake_batches(config, device):
    """The data loader's microbatches as fake tensors, made when read (under the tracker, as a real
    loader's are): one iterator, or one per model chunk with virtual pipeline stages."""
    b, s = config.train.micro_batch_size, config.model.seq_length
    mask = getattr(config.dataset, "create_attention_mask", False) and config.dataset.blend is not None

    def batches():
        while True:
            batch = {
                "tokens": torch.zeros(b, s, dtype=torch.long, device=device),
                "labels": torch.zeros(b, s, dtype=torch.long, device=device),
                "loss_mask": torch.ones(b, s, dtype=torch.float32, device=device),
                "position_ids": torch.zeros(b, s, dtype=torch.long, device=device),
            }
            if mask:
                batch["attention_mask"] = torch.zeros(b, 1, s, s, dtype=torch.bool, device=device)
            yield batch

    vp = config.model.virtual_pipeline_model_parallel_size or 1
    return batches() if vp == 1 else [batches() for _ in range(vp)]


class _NoTimer:
    def __call__(self, *args, **kwargs):
        return self

    def start(self, *args, **kwargs):
        pass

    def stop(self, *args, **kwargs):
        pass


@contextlib.contextmanager
def _fake_world(config, rank: int):
    """This process as global rank ``rank`` of a fake world of the job's size, its groups and seeds
    made by the workers' own ``initialize_megatron``."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    from megatron_lite.core import parallel_state
    from megatron_lite.training.initialize import initialize_megatron

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=config.world_size)
    try:
        yield initialize_megatron(config)  # joins the world already there, as under torchrun
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _stage_ranks(config) -> list[int]:
    """The global ranks of the pipeline stages at TP / CP / DP rank 0 (the groups' own order)."""
    with _fake_world(config, 0) as pg:
        return dist.get_process_group_ranks(pg.pp)


def dry_run_microbatches(config) -> int:
    """Microbatches the dry run drives: the fewest whose schedule holds, on every stage and chunk, as
    many microbatches in flight at once as all of them do (the schedule's own count,
    ``in_flight_microbatch_chunks``) and takes at least one steady-state step; from there on each
    further microbatch repeats the same allocations and frees. All of them under
    --defer-embedding-wgrad-compute, whose buffers grow with every microbatch until the flush."""
    from megatron_lite.core.pipeline_parallel.interleaved import get_pp_rank_microbatches

    m, total = config.model, config.num_microbatches
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    group = m.microbatch_group_size_per_vp_stage or pp
    if m.defer_embedding_wgrad_compute or pp == 1:
        return total if m.defer_embedding_wgrad_compute else min(total, 2)

    target = most_in_flight(config, total)
    if vp == 1:  # plain 1F1B: stage 0's pp - 1 warmup forwards, then its first steady step
        counts = range(pp, total)
    else:
        counts = (
            c for c in range(group, total, group) if get_pp_rank_microbatches(c, vp, group, pp, 0)[3] >= 1
        )
    for count in counts:
        if most_in_flight(config, count) == target:
            return count
    return total


def _with_microbatches(config, count: int):
    """A shallow copy of ``config`` whose global batch is ``count`` microbatches per DP rank."""
    config, train = copy.copy(config), copy.copy(config.train)
    train.global_batch_size = count * train.micro_batch_size * config.data_parallel_size
    config.train = train
    return config


def measure_stage(config, rank: int, device_type: str = "cpu") -> tuple[int, int]:
    """(allocated peak, static bytes at it) of global rank ``rank``: the optimizer's first step (its
    state allocated, on zero gradients) and then one training step with the state resident, as a
    real run's second; on fake tensors in a fake world. Run it in a process of its own: a built model
    is not freed by the garbage collector (its C++ autograd hooks hold it), and the tracker would count
    it in the next stage's run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_lite.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator
    from megatron_lite.core.utils import fake_world_stands_for
    from megatron_lite.training.gpt_step import forward_step
    from megatron_lite.training.memory.allocated import ALLOCATED_MEMORY
    from megatron_lite.training.setup import build_model_and_optimizer
    from megatron_lite.training.state import GlobalState
    from megatron_lite.training.training import train_step

    state = GlobalState()
    state.cfg = config
    ALLOCATED_MEMORY.reset(storage_device="meta")
    stands_for = fake_world_stands_for("nccl" if device_type == "cuda" else "gloo")
    with stands_for, _fake_world(config, rank) as pg, FakeTensorMode(allow_non_fake_inputs=True):
        t = config.train
        reconfigure_num_microbatches_calculator(rank, None, t.global_batch_size, t.micro_batch_size,
                                                config.data_parallel_size)  # fmt: skip
        # A GPU job's AdamW is PyTorch's foreach one (its CUDA default); the CPU's is the per-tensor loop.
        model, optimizer = build_model_and_optimizer(
            config, pg, foreach=True if device_type == "cuda" else None
        )
        with ALLOCATED_MEMORY.track():
            optimizer.step()
        data = _fake_batches(config, next(model[0].parameters()).device)
        train_step(partial(forward_step, state), data, model, optimizer, _NoScheduler(), config, _NoTimer(),
                   pg, track_activation_memory=True)  # fmt: skip
    return ALLOCATED_MEMORY.peak_bytes, ALLOCATED_MEMORY.peak_static_bytes


class _NoScheduler:
    def step(self, increment: int) -> None:
        pass  # the learning rate changes no tensor's size


def _measure_in_child(args) -> tuple[int, int, float]:
    config, rank, device_type = args
    start = time.perf_counter()
    with warnings.catch_warnings():  # the job's own warnings were the preflight's to give, once
        warnings.simplefilter("ignore")
        peak, static = measure_stage(config, rank, device_type)
    return peak, static, time.perf_counter() - start


def dry_run_stages(config, device_type: str = "cpu", out=None) -> list[StageDryRun]:
    """Every pipeline stage's dry run for ``config`` (a validated ConfigContainer), identical stages
    measured once, each in a forked process of its own, as many at once as there are CPUs. ``out``:
    a stream for one line per stage measured."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # its first use imports torch._dynamo: once here, not in every child
        torch.empty(1) + 1
    config = _with_microbatches(config, dry_run_microbatches(config))
    in_flight = most_in_flight(config, config.num_microbatches)
    ranks = _stage_ranks(config)
    first_of: dict[tuple, int] = {}  # signature -> the stage measured for it
    for stage in range(config.model.pipeline_model_parallel_size):
        first_of.setdefault(_stage_signature(config, stage, in_flight[stage]), stage)
    todo = sorted(set(first_of.values()))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # Fork where it is safe (Linux): the child starts with torch imported; elsewhere a fresh process.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    results = {}
    with context.Pool(min(len(todo), cpus or 1), maxtasksperchild=1) as pool:
        jobs = [(config, ranks[stage], device_type) for stage in todo]
        for stage, (peak, static, seconds) in zip(todo, pool.imap(_measure_in_child, jobs)):
            results[stage] = StageDryRun(stage, peak, static, seconds, stage)
            if out is not None:
                print(f"   dry run: stage {stage} measured in {seconds:.1f} s", file=out, flush=True)
    stages = []
    for stage in range(config.model.pipeline_model_parallel_size):
        twin = results[first_of[_stage_signature(config, stage, in_flight[stage])]]
        stages.append(
            twin
            if twin.pp_rank == stage
            else StageDryRun(stage, twin.max_allocated_bytes, twin.static_bytes, 0.0, twin.pp_rank)
        )
    return stages
