"""Measured and predicted memory of every pipeline stage of a real run (tests and bench/memory_prediction.py).

The run is the real pretrain() in a real gloo world with --log-memory-to-tensorboard
--log-memory-per-pp-stage; peak saved activations, weights, gradient buffers and optimizer state are
read back from its event files (the last three also counted exactly from each rank's tensors after
training, which must agree), and the predictions from the ``memory/pp-stage-<i>/predicted-*`` tags the
run logged at start.
"""

from __future__ import annotations

import torch
from dist_helpers import run_world
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.profiler import ProfilerActivity, profile


def profiler_peak_and_final(fn) -> tuple[int, int, object]:
    """The CPU allocator's own account of ``fn()``: the running total of its memory events under
    torch.profiler, as (peak, final) bytes beyond what was allocated before, and ``fn``'s result."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    total = peak = 0
    for e in events:
        if e.device_type() == torch._C._autograd.DeviceType.CPU:
            total += e.nbytes()
            peak = max(peak, total)
    return peak, total, result


QUANTITIES = ("weights", "grads", "optimizer", "activations", "peak")
MEASURED_TAGS = {
    "peak": "mem-max-allocated-gigabytes",
    "weights": "mem-weights-gigabytes",
    "grads": "mem-grads-gigabytes",
    "optimizer": "mem-optimizer-state-gigabytes",
    "activations": "mem-max-activation-gigabytes",
}
PREDICTED_TAGS = {
    "peak": "predicted-max-allocated-gigabytes",
    "weights": "predicted-weights-gigabytes",
    "grads": "predicted-grads-gigabytes",
    "optimizer": "predicted-optimizer-state-gigabytes",
    "activations": "predicted-max-activation-gigabytes",
}


def _train_and_measure(rank, world, argv, quiet):
    """pretrain() on this rank; then the bytes of its parameters, DDP gradient buffers and optimizer
    state (the latter exact, beside the logged value rounded to 5 digits)."""
    import contextlib
    import os

    import torch.distributed as dist

    import megatron_lite.training.pretrain as pretrain_module
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.gpt_step import forward_step

    captured = {}
    real_setup = pretrain_module.setup

    def recording_setup(state):
        s = real_setup(state)
        pg = s.pg_collection
        captured.update(
            s=s, ranks=tuple(0 if g is None else dist.get_rank(g) for g in (pg.pp, pg.tp, pg.cp, pg.dp))
        )
        return s

    pretrain_module.setup = recording_setup
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull if quiet else None):
        pretrain_module.pretrain(parse_args(argv), forward_step)
    chunks = captured["s"].model
    weights = sum(p.numel() * p.element_size() for c in chunks for p in c.module.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for c in chunks for b in c.buffers)
    pp, tp, cp, dp = captured["ranks"]
    optimizer = captured["s"].optimizer.optimizer_state_bytes()
    return {
        "pp": pp,
        "tp": tp,
        "cp": cp,
        "dp": dp,
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
    }


def measure(argv: list[str], world: int, tb_dir, quiet: bool = False) -> list[dict[str, tuple[float, float]]]:
    """Per stage: ``{quantity: (measured GB, predicted GB)}`` for the writer's TP, CP and DP rank
    (``quiet``: the workers' console output is dropped)."""
    argv = [
        *argv,
        "--log-memory-to-tensorboard",
        "--log-memory-per-pp-stage",
        "--tensorboard-dir",
        str(tb_dir),
    ]
    ranks = run_world(_train_and_measure, world, argv, quiet)
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])

    def last(stage, name):
        tag = f"memory/pp-stage-{stage}/{name}"
        assert tag in tags, f"{tag} not logged"
        return acc.Scalars(tag)[-1].value

    # The per-stage events come from the writer's (the last rank's) pipeline: measure the same ranks.
    writer = ranks[-1]
    same = [r for r in ranks if all(r[k] == writer[k] for k in ("tp", "cp", "dp"))]
    stages = []
    for r in sorted(same, key=lambda r: r["pp"]):
        stage = r["pp"]
        measured = {q: last(stage, tag) for q, tag in MEASURED_TAGS.items()}
        # The logged keys are the measurement; the tensors' exact bytes (not rounded) must agree with them.
        for q in ("weights", "grads", "optimizer"):
            assert abs(measured[q] - r[q] / 1e9) <= 1e-4 * measured[q], (stage, q, measured[q], r[q])
            measured[q] = r[q] / 1e9
        stages.append({q: (measured[q], last(stage, PREDICTED_TAGS[q])) for q in QUANTITIES})
    return stages


# The layouts for the allocated peak: 8 layers, hidden 128, seq 64, vocab 8192, mbs 2, gbs 16
# (per data-parallel rank). name -> (world size, flags).
PEAK_MODEL = (
    "--num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 64 --max-position-embeddings 64 "
    "--vocab-size 8192 --micro-batch-size 2 --train-iters 2 --log-interval 1"
).split()
_FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
_LLAMA = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --group-query-attention "
    "--num-query-groups 4 --untie-embeddings-and-output-weights --disable-bias-linear"
)
PEAK_CASES = {
    "1f1b pp4": (4, "--pipeline-model-parallel-size 4 --global-batch-size 16"),
    "interleaved pp2 vp2": (
        2,
        "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 --global-batch-size 16",
    ),
    "full recompute pp2": (2, f"--pipeline-model-parallel-size 2 {_FULL} --global-batch-size 16"),
    "tp2 pp2 sp": (
        4,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --global-batch-size 16",
    ),
    "distopt pp2 dp2": (
        4,
        "--pipeline-model-parallel-size 2 --use-distributed-optimizer --global-batch-size 32",
    ),
    "llama pp2": (2, f"--pipeline-model-parallel-size 2 {_LLAMA} --global-batch-size 16"),
    "bf16 pp2": (2, "--pipeline-model-parallel-size 2 --bf16 --global-batch-size 16"),
}


def peak_argv(name: str, *extra: str) -> tuple[list[str], int]:
    """(pretrain.py's flags, world size) of PEAK_CASES[name], with ``extra`` flags appended."""
    world, flags = PEAK_CASES[name]
    return [*PEAK_MODEL, *flags.split(), "--nproc-per-node", str(world), *extra], world
