"""bench/pipeline_vs_torch_pipelining.py's speed sections: whole training steps, alternated.

``measure`` (on every worker) times, round by round in one world: ours at pp 4 (and over gloo's
sockets instead of shared memory), the peer's Schedule1F1B at pp 4, our single process (pp 1, all
cores) and the same process on one thread (half of it is the two-core ideal), ours with --defer-embedding-wgrad-compute, ours and
ScheduleInterleaved1F1B with vp 2, ours and Schedule1F1B on a 3-2-2-1 layer split (the last stage
also runs the output layer), and ours on that split with --defer-embedding-wgrad-compute; then ours with bf16 against fp32 (a quarter of the rounds: bf16 can
be many times slower); then the scaling grid (pp x microbatches). ``report``
prints them (rank 0's clock: it starts every pipeline and is the last to finish its backward).
"""

from __future__ import annotations

import random
import statistics
import time

import torch
import torch.distributed as dist
from pipeline_training_steps import Groups, cpu_matmul_kernels, mock_batches, ours, peer, threads_for

from megatron_lite.core.pipeline_parallel.shared_memory_p2p import ENV_SWITCH

PIPELINE = 4
SCALING_PP = (1, 2, 4)
SCALING_MICROBATCHES = (4, 8, 16, 32)
HEADLINE_MICROBATCHES = 8
VIRTUAL = 2  # the interleaved contenders' model chunks per rank
SPLIT = (3, 1)  # the uneven contenders' first and last stages' layers: 3-2-2-1
(
    OURS,
    SOCKETS,
    DEFER,
    PEER,
    SINGLE,
    ONE_THREAD,
    BF16,
    OURS_VP,
    PEER_VP,
    OURS_SPLIT,
    PEER_SPLIT,
    SPLIT_DEFER,
) = (
    "megatron_lite pp 4",
    "megatron_lite pp 4, p2p over gloo's sockets",
    "megatron_lite pp 4 --defer-embedding-wgrad-compute",
    "Schedule1F1B pp 4",
    "megatron_lite 1 process",
    "1 process, 1 thread",
    "megatron_lite pp 4 --bf16",
    "megatron_lite pp 4 vp 2",
    "ScheduleInterleaved1F1B pp 4 vp 2",
    "megatron_lite pp 4, 3-2-2-1 layers",
    "Schedule1F1B pp 4, 3-2-2-1 layers",
    "megatron_lite pp 4, 3-2-2-1 layers --defer-embedding-wgrad-compute",
)


def _timed(pp: int, threads: int, run) -> tuple[float | None, object]:
    """One contender's iteration between world barriers; ``run`` is None on ranks outside its
    pipeline (they wait in the barrier). Collective over the world."""
    dist.barrier()
    elapsed, out = None, None
    if run is not None:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        out = run()
        elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed, out


def _alternate(contenders: dict, rounds: int) -> tuple[dict, dict]:
    """Warm-up (its loss kept), then ``rounds`` rounds running each contender once in turn, the order
    rotated by one each round: a contender runs after each of the others equally often (what ran
    just before, the allocator's and the caches' state it leaves, otherwise biases one of them)."""
    losses = {name: _timed(*spec)[1] for name, spec in contenders.items()}
    names = list(contenders)
    times: dict = {name: [] for name in contenders}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_timed(*contenders[name])[0])
    return times, losses


def measure(make_provider, mbs: int, rounds: int, scaling_rounds: int, skip_scaling: bool) -> dict:
    """This rank's times and first-iteration losses. Collective over the world (ranks 0..3)."""
    rank = dist.get_rank()
    groups = Groups(dist.get_world_size(), SCALING_PP, sockets=PIPELINE)
    batches = mock_batches(max(SCALING_MICROBATCHES), make_provider(1), mbs)
    m = HEADLINE_MICROBATCHES

    def member(pp: int, build):
        return build() if rank < pp else None

    single = member(1, lambda: ours(make_provider, groups, 1, [m], batches, mbs)[m])
    headline = {
        OURS: (PIPELINE, 1, ours(make_provider, groups, PIPELINE, [m], batches, mbs)[m]),
        SOCKETS: (PIPELINE, 1, ours(make_provider, groups, PIPELINE, [m], batches, mbs, sockets=True)[m]),
        DEFER: (PIPELINE, 1, ours(lambda pp, vp=1: make_provider(pp, vp=vp, defer=True), groups, PIPELINE, [m], batches, mbs)[m]),
        PEER: (PIPELINE, 1, peer(make_provider, groups, PIPELINE, batches, m)),
        SINGLE: (1, threads_for(1), single),
        ONE_THREAD: (1, 1, single),
        OURS_VP: (PIPELINE, 1, ours(make_provider, groups, PIPELINE, [m], batches, mbs, vp=VIRTUAL)[m]),
        PEER_VP: (PIPELINE, 1, peer(make_provider, groups, PIPELINE, batches, m, vp=VIRTUAL)),
        OURS_SPLIT: (PIPELINE, 1, ours(lambda pp, vp=1: make_provider(pp, vp=vp, split=SPLIT), groups, PIPELINE, [m], batches, mbs)[m]),
        PEER_SPLIT: (PIPELINE, 1, peer(lambda pp, vp=1: make_provider(pp, vp=vp, split=SPLIT), groups, PIPELINE, batches, m)),
        SPLIT_DEFER: (PIPELINE, 1, ours(lambda pp, vp=1: make_provider(pp, vp=vp, split=SPLIT, defer=True), groups, PIPELINE, [m], batches, mbs)[m]),
    }  # fmt: skip
    times, losses = _alternate(headline, rounds)
    # bf16 against fp32 on their own, fewer rounds: without bf16 units a bf16 step takes many fp32 ones.
    bf16 = {
        OURS: headline[OURS],
        BF16: (PIPELINE, 1, ours(lambda pp, vp=1: make_provider(pp, bf16=True, vp=vp), groups, PIPELINE, [m], batches, mbs)[m]),
    }  # fmt: skip
    bf16_times, bf16_losses = _alternate(bf16, max(2, rounds // 4))
    losses[BF16] = bf16_losses[BF16]
    result = {"times": times, "bf16": bf16_times, "loss": losses, "scaling": {}}
    if not skip_scaling:
        grid = {}
        for pp in SCALING_PP:
            runs = member(
                pp, lambda pp=pp: ours(make_provider, groups, pp, SCALING_MICROBATCHES, batches, mbs)
            )
            for mb in SCALING_MICROBATCHES:
                grid[(pp, mb)] = (pp, threads_for(pp), runs[mb] if runs else None)
        result["scaling"] = _alternate(grid, scaling_rounds)[0]
    return result


def _median_ms(values) -> float:
    return statistics.median(values) * 1000


def _paired(times: dict, num: str, den: str) -> str:
    """The ratio num / den round by round (both ran in the same round, so a machine slower for a
    while slows both): its median and quartiles, how far one run's medians can be trusted."""
    ratios = [a / b for a, b in zip(times[num], times[den])]
    if len(ratios) < 2:
        return f"round by round {ratios[0]:.3f}"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    low, high = _median_interval(ratios)
    return (
        f"round by round: median {statistics.median(ratios):.3f}, quartiles {q1:.3f}-{q3:.3f},"
        f" 90% interval of the median {low:.3f}-{high:.3f}"
    )


def _median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval of the median (a fixed seed: the same rounds print the same
    interval). A goal is met beyond this run's noise only when the whole interval clears it."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.05 * resamples)], medians[int(0.95 * resamples) - 1]


def _check_losses(loss: dict, rtol: float) -> None:
    """Ours, the peer and the single process start from equal weights and data: equal work only if
    their first-iteration losses agree."""
    reference = loss[OURS]
    for name in (SOCKETS, DEFER, PEER, SINGLE, OURS_VP, PEER_VP, OURS_SPLIT, PEER_SPLIT, SPLIT_DEFER):
        if not abs(loss[name] - reference) <= rtol * abs(reference):
            raise SystemExit(
                f"first-iteration losses differ: {OURS} {reference:.7f}, {name} {loss[name]:.7f}"
            )
    print(
        "first-iteration loss: "
        + ", ".join(
            f"{n} {loss[n]:.7f}"
            for n in (
                OURS,
                SOCKETS,
                DEFER,
                PEER,
                SINGLE,
                OURS_VP,
                PEER_VP,
                OURS_SPLIT,
                PEER_SPLIT,
                SPLIT_DEFER,
                BF16,
            )
        )
        + f" (fp32 ones checked equal within {rtol:g})"
    )


def report(results: list, rtol: float) -> None:
    """Print the speed sections from every rank's ``measure`` result (sorted by rank)."""
    times = results[0][1]["times"]
    loss = {n: next(r[1]["loss"][n] for r in results if r[1]["loss"][n] is not None) for n in [*times, BF16]}
    ms = {name: _median_ms(v) for name, v in times.items()}
    ideal = ms[ONE_THREAD] / 2
    cores = threads_for(1)
    print(
        f"-- training step (forward-backward, grad-norm clip, AdamW), {HEADLINE_MICROBATCHES} microbatches,"
        f" fp32, {cores} cores; median of alternated rounds"
    )
    _check_losses(loss, rtol)
    fastest = {name: min(v) * 1000 for name, v in times.items()}
    rows = [
        (f"{OURS} ({PIPELINE} processes x {threads_for(PIPELINE)} thread)", ms[OURS], fastest[OURS]),
        (f"{SOCKETS} ({ENV_SWITCH}=0)", ms[SOCKETS], fastest[SOCKETS]),
        (DEFER, ms[DEFER], fastest[DEFER]),
        (f"{PEER} (torch.distributed.pipelining)", ms[PEER], fastest[PEER]),
        (f"{SINGLE} ({cores} threads, no pipeline)", ms[SINGLE], fastest[SINGLE]),
        (f"two-core ideal ({ONE_THREAD}: {ms[ONE_THREAD]:.1f} ms, halved)", ideal, fastest[ONE_THREAD] / 2),
        (f"{OURS_VP} (interleaved 1F1B)", ms[OURS_VP], fastest[OURS_VP]),
        (f"{PEER_VP} (torch.distributed.pipelining)", ms[PEER_VP], fastest[PEER_VP]),
        (OURS_SPLIT, ms[OURS_SPLIT], fastest[OURS_SPLIT]),
        (f"{PEER_SPLIT} (torch.distributed.pipelining)", ms[PEER_SPLIT], fastest[PEER_SPLIT]),
        (SPLIT_DEFER, ms[SPLIT_DEFER], fastest[SPLIT_DEFER]),
    ]
    # The fastest round beside the median: other load on the machine only ever slows a round down.
    print(f"{'contender':<62}{'ms/iteration':>14}{'fastest round':>15}")
    for name, value, best in rows:
        print(f"{name:<62}{value:>14.1f}{best:>15.1f}")
    print(
        f"peer / ours: {ms[PEER] / ms[OURS]:.3f} (ours' speed over the peer's; goal >= 1.03; "
        f"{_paired(times, PEER, OURS)})"
    )
    print(
        f"single-process / ours: {ms[SINGLE] / ms[OURS]:.3f} (ours' speed over one process; goal >= 0.97; "
        f"{_paired(times, SINGLE, OURS)})"
    )
    print(f"ideal / ours: {ideal / ms[OURS]:.3f} (1.0 would be no overhead and no bubble at all)")
    print(
        f"p2p through shared memory: {ms[SOCKETS] / ms[OURS]:.3f}x the speed over gloo's sockets"
        f" ({_paired(times, SOCKETS, OURS)}); over the sockets, peer / ours {ms[PEER] / ms[SOCKETS]:.3f}"
        f" ({_paired(times, PEER, SOCKETS)}), single-process / ours {ms[SINGLE] / ms[SOCKETS]:.3f}"
    )
    print(
        f"--defer-embedding-wgrad-compute: peer / ours {ms[PEER] / ms[DEFER]:.3f}, single-process / ours"
        f" {ms[SINGLE] / ms[DEFER]:.3f}, ideal / ours {ideal / ms[DEFER]:.3f}; {ms[OURS] / ms[DEFER]:.3f}x"
        f" the default's speed ({_paired(times, OURS, DEFER)}; the last stage's output-layer wgrad GEMMs"
        " run in its cooldown wait)"
    )
    print(
        f"interleaved, vp {VIRTUAL}: peer / ours {ms[PEER_VP] / ms[OURS_VP]:.3f}, single-process / ours"
        f" {ms[SINGLE] / ms[OURS_VP]:.3f}, ideal / ours {ideal / ms[OURS_VP]:.3f} (its bubble is 1 / vp of"
        " plain 1F1B's)"
    )
    print(
        f"3-2-2-1 layers (--decoder-first-pipeline-num-layers {SPLIT[0]} --decoder-last-pipeline-num-layers"
        f" {SPLIT[1]}, the same split for both): peer / ours {ms[PEER_SPLIT] / ms[OURS_SPLIT]:.3f},"
        f" single-process / ours {ms[SINGLE] / ms[OURS_SPLIT]:.3f}; {ms[OURS] / ms[OURS_SPLIT]:.3f}x the even"
        f" split's speed ({_paired(times, OURS, OURS_SPLIT)}), the peer's {ms[PEER] / ms[PEER_SPLIT]:.3f}x"
    )
    print(
        f"3-2-2-1 layers and --defer-embedding-wgrad-compute: peer (same split) / ours"
        f" {ms[PEER_SPLIT] / ms[SPLIT_DEFER]:.3f} ({_paired(times, PEER_SPLIT, SPLIT_DEFER)}),"
        f" single-process / ours {ms[SINGLE] / ms[SPLIT_DEFER]:.3f} ({_paired(times, SINGLE, SPLIT_DEFER)}),"
        f" ideal / ours {ideal / ms[SPLIT_DEFER]:.3f}"
    )
    kernels = cpu_matmul_kernels()
    bf16 = {name: _median_ms(v) for name, v in results[0][1]["bf16"].items()}
    print(
        f"-- --bf16 against fp32, {OURS}, alternated on their own: fp32 {bf16[OURS]:.1f} ms, bf16 {bf16[BF16]:.1f} ms"
        f" per iteration, bf16 speed-up {bf16[OURS] / bf16[BF16]:.3f}x ({_paired(results[0][1]['bf16'], OURS, BF16)})"
    )
    print(
        f"CPU: {kernels.get('cpu flags')}; ATen CPU capability {kernels.get('capability')}, oneDNN"
        f" available {kernels.get('mkldnn')}; a bf16 linear runs {kernels.get('bfloat16')};"
        f" an fp32 linear runs {kernels.get('float32')}"
    )
    scaling = results[0][1]["scaling"]
    if not scaling:
        return
    print("-- scaling: megatron_lite training step, median ms/iteration (micro-batch 2, global batch 2 m);")
    print("   in brackets the ideal 1F1B bubble (pp - 1) / (m + pp - 1)")
    print(f"{'pp':<4}{'threads':>8}" + "".join(f"{f'm = {m}':>18}" for m in SCALING_MICROBATCHES))
    for pp in SCALING_PP:
        cells = "".join(
            f"{_median_ms(scaling[(pp, m)]):>10.1f} ({(pp - 1) / (m + pp - 1):.2f})"
            for m in SCALING_MICROBATCHES
        )
        print(f"{pp:<4}{threads_for(pp):>8}{cells}")
