"""Will it fit? The per-stage memory prediction for an exact command line, before any GPU hour is spent.

    python pretrain.py ... --memory-preflight --device-memory-gb 80

Builds no world and trains nothing: predicts each pipeline stage's weights, gradients, optimizer state,
peak activations, the temporaries alive at its peak and so its allocated peak for the layout as given
(predict/stages.py), prints them beside the device's memory, names the first stage expected to run
out, and searches the memory levers for the cheapest change that makes every stage fit. Exit 0 when it
fits, 1 when it does not, 2 on bad input.

A stage fits when its predicted allocated peak leaves ``RESERVE_FRACTION`` of the device free. The peak
counts every tensor the step allocates, temporaries included (the same figure as
``mem-max-allocated-bytes``, checked against CPU runs within 3%); the reserve is for what a GPU adds that
no tensor shows: the CUDA context and kernels (0.5-1 GB), NCCL's communication buffers (hundreds of MB
per communicator), and the caching allocator's block rounding and fragmentation (``mem-max-reserved``
over ``mem-max-allocated``, typically a few percent, more with varying shapes).
"""

from __future__ import annotations

import itertools
import sys
import time
import warnings
from dataclasses import dataclass

from megatron_lite.core.transformer.pipeline_layer_split import pipeline_layer_counts
from megatron_lite.training.config.ranges import RANGES, check_value
from megatron_lite.training.errors import ConfigError

RESERVE_FRACTION = 0.10
PREFLIGHT_FLAGS = ("--memory-preflight", "--device-memory-gb")


@dataclass(frozen=True)
class Change:
    """A set of flags and its rough price in extra step time (a fraction: 0.25 = 25% slower)."""

    flags: tuple[str, ...]
    cost: float
    why: str


def _recompute_changes(layers_per_chunk: int) -> list[Change]:
    # Selective recompute re-runs only core attention; full recompute of N of a chunk's layers re-runs
    # their forward in backward (a forward is about a third of a step).
    changes = [Change(("--recompute-granularity", "selective"), 0.03, "recompute core attention")]
    for n in range(1, layers_per_chunk + 1):
        flags = (
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            str(n),
        )
        changes.append(Change(flags, 0.33 * n / layers_per_chunk, f"recompute {n} layer(s) per chunk"))
    return changes


def _split_changes(m) -> list[Change]:
    """Move k layers from the first stage (the most microbatches in flight, and the embedding) to the
    last (the fewest): its weights, gradients, optimizer state and activations leave stage 0. The last
    stage then does k more layers of work per microbatch, and 1F1B runs at its slowest stage's pace."""
    pp = m.pipeline_model_parallel_size
    split_given = (
        m.num_layers_in_first_pipeline_stage is not None
        or m.num_layers_in_last_pipeline_stage is not None
        or m.account_for_embedding_in_pipeline_split
        or m.account_for_loss_in_pipeline_split
        or m.pipeline_model_parallel_layout is not None
    )
    if pp == 1 or split_given or m.num_layers % pp:  # only an even split of this depth is moved from
        return []
    n = m.num_layers // pp
    changes = []
    for k in range(1, n):
        flags = (
            "--decoder-first-pipeline-num-layers",
            str(n - k),
            "--decoder-last-pipeline-num-layers",
            str(n + k),
        )
        changes.append(Change(flags, k / n, f"{k} layer(s) moved from the first stage to the last"))
    return changes


def candidate_changes(config) -> list[Change]:
    """Every combination of the levers this layout can still pull, cheapest first."""
    m = config.model
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    vp = m.virtual_pipeline_model_parallel_size or 1
    sp = (
        [None]
        if m.sequence_parallel or tp == 1
        else [
            None,
            Change(("--sequence-parallel",), 0.0, "sequence parallel: norms and dropout split over tp"),
        ]
    )
    distributed = config.optimizer.use_distributed_optimizer or config.data_parallel_size == 1
    distopt = (
        [None]
        if distributed
        else [None, Change(("--use-distributed-optimizer",), 0.01, "optimizer state sharded over dp")]
    )
    recompute = [None] + (
        []
        if m.recompute_granularity == "full"
        else _recompute_changes(max(map(max, pipeline_layer_counts(m))))
    )
    # The last stage's deferred output-layer wgrad buffers: keep one microbatch's, not all of them.
    deferral = [None]
    if m.defer_embedding_wgrad_compute and m.wgrad_deferral_limit != 1:
        why = "defer one microbatch's output-layer wgrad, not every one"
        deferral.append(Change(("--wgrad-deferral-limit", "1"), 0.02, why))
    # A deeper pipeline spreads weights and optimizer state over more GPUs: the dearest change.
    world = config.world_size
    slots = (
        m.num_layers
        + int(m.account_for_embedding_in_pipeline_split)
        + int(m.account_for_loss_in_pipeline_split)
    )
    deeper = [None] + [
        Change(
            ("--pipeline-model-parallel-size", str(pp * k), "--nproc-per-node", str(world * k)),
            float(k - 1),
            f"{k}x the GPUs",
        )
        for k in (2, 4)
        if slots % (pp * k * vp) == 0
    ]
    # Moving layers is a lever of this depth only: a deeper pipeline gets the split as given.
    split = [(None, None)] + [(c, None) for c in _split_changes(m)] + [(None, c) for c in deeper[1:]]
    combos = []
    for parts in itertools.product(deferral, sp, distopt, recompute, split):
        parts = [*parts[:-1], *parts[-1]]
        chosen = [c for c in parts if c is not None]
        if chosen:
            flags = tuple(f for c in chosen for f in c.flags)
            combos.append(Change(flags, sum(c.cost for c in chosen), "; ".join(c.why for c in chosen)))
    return sorted(combos, key=lambda c: (c.cost, len(c.flags)))


def _config(argv: list[str]):
    from megatron_lite.training.arguments import config_from_argv

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_from_argv(argv)


def _gb(num_bytes: float) -> float:
    return num_bytes / 1e9


def _fits(predictions, capacity_gb: float) -> list[bool]:
    return [_gb(p.peak_bytes) <= capacity_gb * (1 - RESERVE_FRACTION) for p in predictions]


def format_table(predictions, capacity_gb: float) -> str:
    """Per stage, in GB (3 significant digits): the static parts, the saved activations and the
    temporaries at the predicted peak, the peak, and the device's headroom above it."""
    from megatron_lite.training.memory.table import three_digits

    columns = ("weights", "grads", "optim", "act", "temp", "peak", "headroom")
    rows = [f"{'stage':>5}" + "".join(f"{c:>9}" for c in columns) + "   (GB, predicted)"]
    for i, p in enumerate(predictions):
        act = p.peak_bytes - p.weights_bytes - p.grads_bytes - p.optimizer_state_bytes - p.temporaries_bytes
        values = (
            p.weights_bytes,
            p.grads_bytes,
            p.optimizer_state_bytes,
            act,
            p.temporaries_bytes,
            p.peak_bytes,
        )
        cells = [three_digits(_gb(v)) for v in values] + [three_digits(capacity_gb - _gb(p.peak_bytes))]
        rows.append(f"{i:>5}" + "".join(f"{c:>9}" for c in cells))
    return "\n".join(rows)


def preflight(argv: list[str], capacity_gb: float, out=sys.stdout) -> int:
    """Print the prediction and verdict for ``argv`` (pretrain.py's flags without the preflight's)."""
    from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

    config = _config(argv)
    m = config.model
    predictions = predict_memory_per_stage(config, device_type="cuda")
    layout = (
        f"tp {m.tensor_model_parallel_size} x pp {m.pipeline_model_parallel_size} x cp "
        f"{m.context_parallel_size} x dp {config.data_parallel_size}, vp "
        f"{m.virtual_pipeline_model_parallel_size or 1}, {config.num_microbatches} microbatches of "
        f"{config.train.micro_batch_size}"
    )
    print(f" memory preflight ({layout}; a prediction: no world built, nothing trained)", file=out)
    print(format_table(predictions, capacity_gb), file=out)
    usable = capacity_gb * (1 - RESERVE_FRACTION)
    print(
        f" device: {capacity_gb:g} GB, of which {usable:g} GB for the predicted tensors "
        f"({RESERVE_FRACTION:.0%} kept for the CUDA context, NCCL buffers, the allocator's rounding and fragmentation)",
        file=out,
    )
    fits = _fits(predictions, capacity_gb)
    if all(fits):
        peak = max(range(len(predictions)), key=lambda i: predictions[i].peak_bytes)
        print(
            f" verdict: fits; the peak is stage {peak}'s {_gb(predictions[peak].peak_bytes):.2f} GB",
            file=out,
        )
        return 0
    failing = [i for i, ok in enumerate(fits) if not ok]
    first = max(failing, key=lambda i: (predictions[i].peak_bytes, -i))
    print(
        f" verdict: does not fit: stage {first} runs out first (predicted {_gb(predictions[first].peak_bytes):.2f}"
        f" GB > {usable:g} GB); stages that do not fit: {', '.join(map(str, failing))}",
        file=out,
    )
    for change in candidate_changes(config):
        try:
            candidate = _config([*argv, *change.flags])
        except (ConfigError, ValueError, AssertionError):
            continue
        after = predict_memory_per_stage(candidate, device_type="cuda")
        if all(_fits(after, capacity_gb)):
            peak = max(range(len(after)), key=lambda i: after[i].peak_bytes)
            print(
                f" cheapest change that fits every stage: {' '.join(change.flags)}  ({change.why}; about "
                f"{change.cost:.0%} more time per step; predicted peak {_gb(after[peak].peak_bytes):.2f} GB "
                f"on stage {peak})",
                file=out,
            )
            return 1
    print(
        " no combination of the memory levers makes every stage fit: a smaller micro-batch or model", file=out
    )
    return 1


def main(argv: list[str]) -> int:
    """pretrain.py's entry for --memory-preflight: bad input is one line and exit 2."""
    rest, capacity = [], None
    it = iter(argv)
    for arg in it:
        if arg == "--memory-preflight":
            continue
        if arg == "--device-memory-gb" or arg.startswith("--device-memory-gb="):
            value = arg.split("=", 1)[1] if "=" in arg else next(it, None)
            try:
                capacity = float(value)
                check_value("--device-memory-gb", capacity)
            except (TypeError, ValueError):  # ConfigError is a ValueError
                print(
                    f"pretrain.py: error: --device-memory-gb: must be {RANGES['--device-memory-gb']} (GB), "
                    f"got {value!r}",
                    file=sys.stderr,
                )
                return 2
            continue
        rest.append(arg)
    if capacity is None:
        print(
            "pretrain.py: error: --memory-preflight: needs --device-memory-gb (the GPU's memory)",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    try:
        code = preflight(rest, capacity)
    except ConfigError as err:
        print(f"pretrain.py: error: {err}", file=sys.stderr)
        return 2
    print(f" (preflight took {time.perf_counter() - start:.2f} s)")
    return code
