#!/usr/bin/env python
"""megatron_lite's pipeline schedules against torch.distributed.pipelining's, same model, same processes.

    python bench/pipeline_vs_torch_pipelining.py [--rounds 10] [--schedule {1f1b,interleaved,both}]
        [--scaling-rounds 3] [--skip-scaling] [--skip-speed]
        [--hidden-size 256] [--seq-length 128] [--vocab-size 8192]

GPT: 8 layers, hidden 256, 8 heads, seq 128, micro-batch 2, global batch 16 (8 microbatches), vocab
8192 (smaller sizes make a smoke run), fp32, pp = 4 on CPU with gloo. ``1f1b``: our 1F1B against
``Schedule1F1B``, one stage of two layers per rank. ``interleaved``: our interleaved 1F1B against
``ScheduleInterleaved1F1B`` with vp = 2, each rank holding two chunks of one layer (Megatron's
assignment: chunk c of rank r holds layer c * pp + r, torch's stage index c * pp + r). Both sides of a
comparison run identically built stage modules (untied embeddings, so neither pays for an embedding
all-reduce) on the same data, are checked to give the same first-iteration loss, and are alternated
round by round. Ours moves activations and gradients between its stages through shared memory (all
ranks on one host, as pretrain.py's workers do), the peer through gloo's sockets. Prints the median
ms per global-batch forward-backward for each, their ratio, and each stage's peak bytes of activations saved for backward (measured by megatron_lite's
ActivationMemoryTracker around each schedule); for the interleaved schedule also the in-flight
microbatch-chunk counts our schedule predicts per rank and the stage-0 peak over plain 1F1B's beside
Megatron's interleaving factor 1 + (pp - 1) / (pp * vp).

Then (unless ``--skip-speed``, see bench/pipeline_speed.py) whole training steps, forward-backward +
grad-norm clip + AdamW, alternated round by round in the same world: ours at pp 4 (and over
gloo's sockets, MEGATRON_LITE_P2P_SHARED_MEMORY=0, to show what the transport alone gives), the peer's
Schedule1F1B at pp 4 with torch's AdamW, our single process on all cores (no pipeline, the 8
microbatches as gradient accumulation) and on one thread (halved: the two-core ideal), ours with
``--defer-embedding-wgrad-compute``, ours and ScheduleInterleaved1F1B with vp 2, ours and
Schedule1F1B with 3-2-2-1 layers per stage (``--decoder-first-pipeline-num-layers 3
--decoder-last-pipeline-num-layers 1``: the last stage also runs the output layer), ours on that split
with ``--defer-embedding-wgrad-compute``, with the ratios (the
order rotated each round; each ratio also round by round); ours with ``--bf16`` against fp32 (in a
quarter of the rounds) and which CPU matmul kernel bf16 runs; and (unless
``--skip-scaling``) ms/iteration for pp in {1, 2, 4} x microbatches in {4, 8, 16, 32} beside the ideal
1F1B bubble (pp - 1) / (m + pp - 1). The default run takes a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import os
import queue as queue_module
import statistics
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pipeline_speed  # noqa: E402  (bench/, beside this script)
from pipeline_training_steps import TorchPipelineStage, mock_batches, peer_loss  # noqa: E402

from megatron_lite.core import parallel_state as ps  # noqa: E402
from megatron_lite.core.distributed import DistributedDataParallel, finalize_model_grads  # noqa: E402
from megatron_lite.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron_lite.core.pipeline_parallel.schedule_order import in_flight_microbatch_chunks  # noqa: E402
from megatron_lite.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron_lite.models.gpt_provider import GPTModelProvider  # noqa: E402
from megatron_lite.training.config import ConfigContainer  # noqa: E402
from megatron_lite.training.gpt_step import forward_step  # noqa: E402
from megatron_lite.training.memory.saved_tensors import ActivationMemoryTracker  # noqa: E402
from megatron_lite.training.state import GlobalState  # noqa: E402

PP, LAYERS, HEADS, MBS, GBS = 4, 8, 8, 2, 16
MICROBATCHES = GBS // MBS
VIRTUAL_STAGES = {"1f1b": 1, "interleaved": 2}  # schedule -> model chunks per rank
OURS, PEER = "megatron_lite", "torch.pipelining"
LOSS_RTOL = 1e-5


def _provider(vp: int, size: dict, pp: int = PP, bf16: bool = False, defer: bool = False, split=None):
    """The benchmarked GPT over ``pp`` stages, ``size`` giving hidden_size, seq_length and vocab_size;
    ``defer``: --defer-embedding-wgrad-compute; ``split``: the first and last stages' layers
    (--decoder-first/last-pipeline-num-layers), None for an even split."""
    first, last = split or (None, None)
    return GPTModelProvider(
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=size["seq_length"],
        **size,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        share_embeddings_and_output_weights=False,
        bf16=bf16,
        defer_embedding_wgrad_compute=defer,
    )


def _runners(vp: int, rank: int, pgc: ProcessGroupCollection, size: dict):
    """(run(tracker) -> mean loss on the last rank else None, modules) for ours and torch's, each side
    holding this rank's ``vp`` chunks, built by the same provider (layout-independent init: equal
    weights). Running either is collective over the pipeline group."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    chunks = range(vp) if vp > 1 else [None]  # vp_stage None: the plain one-stage-per-rank model
    cfg = _provider(vp, size)
    batches = mock_batches(MICROBATCHES, cfg, MBS)
    cfg.finalize_model_grads_func = finalize_model_grads
    ours = [DistributedDataParallel(cfg, cfg.provide(vp_stage=c), dp_group=pgc.dp) for c in chunks]
    schedule = get_forward_backward_func(PP, vp)
    peer_modules = [TorchPipelineStage(_provider(vp, size).provide(vp_stage=c)) for c in chunks]
    device = torch.device("cpu")
    stages = [
        PipelineStage(m, c * PP + rank, PP * vp, device, group=pgc.pp) for c, m in enumerate(peer_modules)
    ]
    if vp > 1:
        peer = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=peer_loss)
    else:
        peer = Schedule1F1B(stages[0], MICROBATCHES, loss_fn=peer_loss)
    first, last = rank == 0, rank == PP - 1

    def run_ours(tracker):
        for chunk in ours:
            chunk.zero_grad_buffer()
        with tracker.track():
            store = schedule(
                forward_step_func=partial(forward_step, GlobalState(ConfigContainer())),
                data_iterator=[iter(batches) for _ in ours],  # every chunk reads each microbatch once
                model=ours,
                num_microbatches=MICROBATCHES,
                seq_length=cfg.seq_length,
                micro_batch_size=MBS,
            )
        return torch.stack([d["lm loss"] for d in store]).mean().item() if last else None

    def run_peer(tracker):
        for module in peer_modules:
            module.zero_grad(set_to_none=True)
        tokens = torch.cat([b["tokens"] for b in batches]) if first else None
        labels = torch.cat([b["labels"] for b in batches]) if last else None
        losses = []
        with tracker.track():
            if first:
                peer.step(tokens)
            elif last:
                peer.step(target=labels, losses=losses)
            else:
                peer.step()
        return torch.stack(losses).mean().item() if last else None

    return {OURS: (run_ours, [c.module for c in ours]), PEER: (run_peer, peer_modules)}


def _compare(vp: int, rank: int, pgc, size: dict, rounds: int) -> dict:
    """Warm-up iteration (activation peaks, first-iteration loss), then ``rounds`` timed rounds,
    ours and torch's alternated. Collective over the pipeline group."""
    runners = _runners(vp, rank, pgc, size)
    result = {"times": {name: [] for name in runners}, "peaks": {}, "loss": {}}
    for name, (run, modules) in runners.items():
        tracker = ActivationMemoryTracker()
        for module in modules:
            tracker.exclude_parameters(module.parameters())
        result["loss"][name] = run(tracker)  # the warm-up iteration also measures the activation peak
        result["peaks"][name] = tracker.peak_bytes
    for _ in range(rounds):
        for name, (run, _) in runners.items():
            tracker = ActivationMemoryTracker()
            dist.barrier()
            start = time.perf_counter()
            run(tracker)
            dist.barrier()
            result["times"][name].append(time.perf_counter() - start)
    return result


def worker(rank, port, args, schedules, size, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // PP))
    dist.init_process_group("gloo", rank=rank, world_size=PP)
    ps.initialize_model_parallel(pipeline_model_parallel_size=PP)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    results = {s: _compare(VIRTUAL_STAGES[s], rank, pgc, size, args.rounds) for s in schedules}
    if not args.skip_speed:

        def make(pp, bf16=False, vp=1, defer=False, split=None):  # the benchmarked GPT, vp chunks per rank
            return _provider(vp, size, pp=pp, bf16=bf16, defer=defer, split=split)

        results["speed"] = pipeline_speed.measure(
            make, MBS, args.rounds, args.scaling_rounds, args.skip_scaling
        )
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def _collect(procs, queue) -> list:
    """Every worker's (rank, results), sorted; exits with one line if a worker died without reporting."""
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except queue_module.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                sys.exit("a bench worker failed (its traceback is above)")
    return sorted(results, key=lambda r: r[0])


def _check_equal_work(title: str, loss: dict) -> None:
    """Both schedules must compute the same loss from the same weights and data, or the timing
    comparison is not of equal work."""
    ours, peer = loss[OURS], loss[PEER]
    if not abs(ours - peer) <= LOSS_RTOL * abs(peer):
        sys.exit(f"{title}: first-iteration losses differ: {OURS} {ours:.7f}, {PEER} {peer:.7f}")
    print(
        f"first-iteration loss: {OURS} {ours:.7f}, {PEER} {peer:.7f} "
        f"(relative difference {abs(ours - peer) / abs(peer):.1e}, checked <= {LOSS_RTOL:g})"
    )


def _report(schedule: str, results: list) -> None:
    """One comparison's section: equal-work check, median times, per-stage activation peaks."""
    vp = VIRTUAL_STAGES[schedule]
    last = results[-1][1][schedule]
    if vp == 1:
        ours = "forward_backward_pipelining_without_interleaving"
        print(f"-- 1F1B: {ours} vs Schedule1F1B, {LAYERS // PP} layers/rank")
    else:
        per_chunk = LAYERS // (PP * vp)
        held = f"layer c * {PP} + r" if per_chunk == 1 else f"layers from {per_chunk} * (c * {PP} + r)"
        print(
            f"-- interleaved 1F1B, vp {vp}: forward_backward_pipelining_with_interleaving vs "
            f"ScheduleInterleaved1F1B; chunk c of rank r holds {held} (torch stage index c * {PP} + r)"
        )
    _check_equal_work(schedule, last["loss"])
    ms = {name: statistics.median(v) * 1000 for name, v in last["times"].items()}
    print(f"{'schedule':<18}{'ms/iteration':>14}")
    for name, value in ms.items():
        print(f"{name:<18}{value:>14.1f}")
    print(f"ratio {OURS} / {PEER}: {ms[OURS] / ms[PEER]:.3f} (< 1 means {OURS} is faster)")
    header = f"{'stage':<7}{OURS + ' act. peak (MB)':>30}{PEER + ' act. peak (MB)':>34}{'ratio':>8}"
    if vp > 1:
        # Predicted: the schedule's own account of the microbatch-chunks a rank holds at its fullest.
        header += f"{'in flight (predicted)':>23}{OURS + ' MB per chunk':>28}"
    print(header)
    for rank, per_schedule in results:
        peaks = per_schedule[schedule]["peaks"]
        a, b = peaks[OURS] / 1e6, peaks[PEER] / 1e6
        line = f"{rank:<7}{a:>30.2f}{b:>34.2f}{a / b:>8.3f}"
        if vp > 1:
            in_flight = max(sum(c) for c in in_flight_microbatch_chunks(MICROBATCHES, vp, PP, rank))
            line += f"{in_flight:>23}{a / in_flight:>28.2f}"
        print(line)


def _report_interleaving_factor(results: list) -> None:
    """Stage 0's peak, interleaved over plain 1F1B, beside Megatron's predicted factor."""
    vp = VIRTUAL_STAGES["interleaved"]
    stage0 = results[0][1]
    ratio = {n: stage0["interleaved"]["peaks"][n] / stage0["1f1b"]["peaks"][n] for n in (OURS, PEER)}
    print(
        f"stage 0 act. peak, interleaved / 1F1B: {OURS} {ratio[OURS]:.3f}, {PEER} {ratio[PEER]:.3f}; "
        f"Megatron's factor 1 + (pp - 1) / (pp * vp) = {1 + (PP - 1) / (PP * vp):.3f} (predicted)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per schedule")
    parser.add_argument(
        "--schedule", choices=[*VIRTUAL_STAGES, "both"], default="both", help="which comparison to run"
    )
    # Megatron's flag names; smaller values make a quick smoke run (the test's).
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--scaling-rounds", type=int, default=3, help="timed rounds of the scaling grid")
    parser.add_argument("--skip-scaling", action="store_true", help="no pp x microbatches scaling table")
    parser.add_argument("--skip-speed", action="store_true", help="only the schedule comparisons")
    args = parser.parse_args()
    if (
        min(args.rounds, args.scaling_rounds, args.hidden_size, args.seq_length, args.vocab_size) < 1
        or args.hidden_size % HEADS
    ):
        parser.error(f"sizes and --rounds must be positive, --hidden-size a multiple of {HEADS}")
    size = {"hidden_size": args.hidden_size, "seq_length": args.seq_length, "vocab_size": args.vocab_size}
    schedules = list(VIRTUAL_STAGES) if args.schedule == "both" else [args.schedule]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # Daemons: when one worker fails, the others (stuck in a collective) end with the bench.
    procs = [
        ctx.Process(target=worker, args=(r, port, args, schedules, size, queue), daemon=True)
        for r in range(PP)
    ]
    for p in procs:
        p.start()
    results = _collect(procs, queue)
    for p in procs:
        p.join()
    print(
        f"GPT {LAYERS} layers, hidden {args.hidden_size}, {HEADS} heads, seq {args.seq_length}, "
        f"micro-batch {MBS}, global batch {GBS}, vocab {args.vocab_size}, fp32, pp {PP}, CPU/gloo, "
        f"{args.rounds} alternated rounds"
    )
    for schedule in schedules:
        _report(schedule, results)
    if len(schedules) == 2:
        _report_interleaving_factor(results)
    if not args.skip_speed:
        pipeline_speed.report([(rank, r["speed"]) for rank, r in results], LOSS_RTOL)


if __name__ == "__main__":
    main()
