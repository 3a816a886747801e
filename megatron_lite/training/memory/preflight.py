"""Will it fit? The per-stage memory prediction for an exact command line, before any GPU hour is spent.

    python pretrain.py ... --memory-preflight --device-memory-gb 80

Builds no world and trains nothing: predicts each pipeline stage's weights, gradients, optimizer state,
peak activations, the temporaries alive at its peak and so its allocated peak for the layout as given
(predict/stages.py), prints them beside the device's memory, names the first stage expected to run
out, and searches the memory levers (levers.py) for the cheapest change that makes every stage fit.
``--memory-preflight-json FILE`` also writes all of it as JSON (atomically), for CI jobs and notebooks.
Exit 0 when it fits, 1 when it does not, 2 on bad input.

A stage fits when its predicted allocated peak leaves ``RESERVE_FRACTION`` of the device free. The peak
counts every tensor the step allocates, temporaries included (the same figure as
``mem-max-allocated-bytes``, checked against CPU runs within 3%); the reserve is for what a GPU adds that
no tensor shows: the CUDA context and kernels (0.5-1 GB), NCCL's communication buffers (hundreds of MB
per communicator), and the caching allocator's block rounding and fragmentation (``mem-max-reserved``
over ``mem-max-allocated``, typically a few percent, more with varying shapes).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

from megatron_lite.training.config.ranges import RANGES, check_value
from megatron_lite.training.errors import ConfigError
from megatron_lite.training.memory.dry_run import DryRunError, dry_run_stages
from megatron_lite.training.memory.levers import candidate_changes
from megatron_lite.utils.atomic_io import WriteFailedError, atomic_write_bytes

RESERVE_FRACTION = 0.10
PREFLIGHT_FLAGS = ("--memory-preflight", "--device-memory-gb", "--memory-preflight-json", "--memory-dry-run")


def _config(argv: list[str]):
    from megatron_lite.training.arguments import config_from_argv

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_from_argv(argv)


def _gb(num_bytes: float) -> float:
    return num_bytes / 1e9


def _fits(predictions, capacity_gb: float, dry=None) -> list[bool]:
    """Per stage: whether its peak (the larger of the prediction and the dry run's measurement, when
    there is one) leaves the reserve free."""
    return [_gb(peak) <= capacity_gb * (1 - RESERVE_FRACTION) for peak in _peaks(predictions, dry)]


def _peaks(predictions, dry=None) -> list[int]:
    """Per stage: the predicted allocated peak, or with a dry run the larger of it and the measured one."""
    if not dry:
        return [p.peak_bytes for p in predictions]
    return [max(p.peak_bytes, d.max_allocated_bytes) for p, d in zip(predictions, dry)]


def format_table(predictions, capacity_gb: float, dry=None) -> str:
    """Per stage, in GB (3 significant digits): the static parts, the saved activations and the
    temporaries at the predicted peak, the peak, the device's headroom above it, and with ``dry``
    (the dry run's StageDryRun list) the dry run's measured peak and its difference from the prediction."""
    from megatron_lite.training.memory.table import three_digits

    columns = ("weights", "grads", "optim", "act", "temp", "peak", "headroom") + (
        ("dry run", "diff%") if dry else ()
    )
    title = "   (GB; predicted" + ("; dry run: measured on fake tensors)" if dry else ")")
    rows = [f"{'stage':>5}" + "".join(f"{c:>9}" for c in columns) + title]
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
        if dry:
            measured = dry[i].max_allocated_bytes
            cells += [three_digits(_gb(measured)), f"{100 * (p.peak_bytes / measured - 1):+.1f}"]
        rows.append(f"{i:>5}" + "".join(f"{c:>9}" for c in cells))
    return "\n".join(rows)


def _activation_bytes(p) -> int:
    """What the table's ``act`` column shows: the peak less the static parts and the temporaries."""
    return p.peak_bytes - p.weights_bytes - p.grads_bytes - p.optimizer_state_bytes - p.temporaries_bytes


def _recommend(argv: list[str], config, capacity_gb: float, margin: float = 1.0):
    """The cheapest change that makes every stage fit, with the predictions under it; (None, None)
    when no combination of the levers does. ``margin``: how much more than predicted the dry run
    measured (at least 1), which a candidate's predictions must leave room for."""
    from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

    usable = capacity_gb * (1 - RESERVE_FRACTION)
    for change in candidate_changes(config):
        try:
            candidate = _config([*argv, *change.flags])
        except (ConfigError, ValueError, AssertionError):
            continue
        after = predict_memory_per_stage(candidate, device_type="cuda")
        if all(_gb(p.peak_bytes * margin) <= usable for p in after):
            return change, after
    return None, None


def preflight_record(
    predictions, capacity_gb: float, fits: bool, recommendation: str | None, dry=None, confirmed=None
) -> dict:
    """The preflight as data (``--memory-preflight-json``): per stage the predicted allocated peak and
    its parts, in bytes, and with ``dry`` the dry run's measured peak; the device; the verdict; the
    flags to add ("" when it fits as given, None when no combination of the levers fits) and, when
    the dry run measured them, whether they fit (``recommendation_confirmed``)."""
    stages = [
        {
            "stage": i,
            "predicted_max_allocated_bytes": p.peak_bytes,
            **({"dry_run_max_allocated_bytes": dry[i].max_allocated_bytes} if dry else {}),
            "weights_bytes": p.weights_bytes,
            "grads_bytes": p.grads_bytes,
            "optimizer_bytes": p.optimizer_state_bytes,
            "activations_bytes": _activation_bytes(p),
            "temporaries_bytes": p.temporaries_bytes,
        }
        for i, p in enumerate(predictions)
    ]
    return {
        "stages": stages,
        "device_bytes": int(capacity_gb * 1e9),
        "reserve_fraction": RESERVE_FRACTION,
        "fits": fits,
        "recommendation": recommendation,
        **({} if confirmed is None else {"recommendation_confirmed": confirmed}),
    }


def _verdict(predictions, capacity_gb: float, dry, out) -> list[bool]:
    fits, peaks = _fits(predictions, capacity_gb, dry), _peaks(predictions, dry)
    usable = capacity_gb * (1 - RESERVE_FRACTION)
    which = "predicted or dry run, the larger" if dry else "predicted"
    if all(fits):
        peak = max(range(len(peaks)), key=lambda i: peaks[i])
        print(f" verdict: fits; the peak is stage {peak}'s {_gb(peaks[peak]):.2f} GB ({which})", file=out)
    else:
        failing = [i for i, ok in enumerate(fits) if not ok]
        first = max(failing, key=lambda i: (peaks[i], -i))
        print(
            f" verdict: does not fit: stage {first} runs out first ({which} {_gb(peaks[first]):.2f} GB > "
            f"{usable:g} GB); stages that do not fit: {', '.join(map(str, failing))}",
            file=out,
        )
    return fits


def preflight(
    argv: list[str], capacity_gb: float, out=sys.stdout, json_path: str | None = None, dry_run: bool = False
) -> int:
    """Print the prediction and verdict for ``argv`` (pretrain.py's flags without the preflight's);
    with ``dry_run``, also each stage's dry run (dry_run.py), and confirm the recommended change with
    one; with ``json_path``, also write them there (atomically)."""
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
    dry = dry_run_stages(config, "cuda", out, "the job as given") if dry_run else None
    how = "predicted, and measured by the dry run" if dry else "a prediction: no world built, nothing trained"
    print(f" memory preflight ({layout}; {how})", file=out)
    print(format_table(predictions, capacity_gb, dry), file=out)
    usable = capacity_gb * (1 - RESERVE_FRACTION)
    print(
        f" device: {capacity_gb:g} GB, of which {usable:g} GB for the predicted tensors "
        f"({RESERVE_FRACTION:.0%} kept for the CUDA context, NCCL buffers, the allocator's rounding and fragmentation)",
        file=out,
    )
    fits = _verdict(predictions, capacity_gb, dry, out)
    recommendation, confirmed = ("" if all(fits) else None), None
    if not all(fits):
        margin = max([1.0] + [d.max_allocated_bytes / p.peak_bytes for p, d in zip(predictions, dry or [])])
        change, after = _recommend(argv, config, capacity_gb, margin)
        if change is None:
            print(
                " no combination of the memory levers makes every stage fit: a smaller micro-batch or model",
                file=out,
            )
        else:
            recommendation = " ".join(change.flags)
            peak = max(range(len(after)), key=lambda i: after[i].peak_bytes)
            print(
                f" cheapest change that fits every stage: {recommendation}  ({change.why}; about "
                f"{change.cost:.0%} more time per step; predicted peak {_gb(after[peak].peak_bytes):.2f} GB "
                f"on stage {peak})",
                file=out,
            )
            if dry_run:  # the lever search's answer, measured
                measured = dry_run_stages(
                    _config([*argv, *change.flags]), "cuda", out, "the job with the change"
                )
                confirmed = all(_fits(after, capacity_gb, measured))
                top = max(measured, key=lambda d: d.max_allocated_bytes)
                print(
                    f" the dry run {'confirms' if confirmed else 'does NOT confirm'} it: peak "
                    f"{_gb(top.max_allocated_bytes):.2f} GB on stage {top.pp_rank}",
                    file=out,
                )
    if json_path is not None:
        record = preflight_record(predictions, capacity_gb, all(fits), recommendation, dry, confirmed)
        text = (json.dumps(record, indent=2) + "\n").encode()
        atomic_write_bytes(json_path, lambda f: f.write(text), needed=len(text))
        print(f" wrote {json_path}", file=out)
    return 0 if all(fits) else 1


def _json_path(value: str | None) -> str:
    """--memory-preflight-json's FILE, refused before anything runs when it cannot be written there."""
    if not value or value.startswith("-"):
        raise ConfigError("--memory-preflight-json", "needs a FILE to write the preflight to")
    directory = os.path.dirname(os.path.abspath(value))
    if os.path.isdir(value) or not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise ConfigError(
            "--memory-preflight-json", f"cannot write {value}: {directory} is not a writable directory"
        )
    return value


def main(argv: list[str]) -> int:
    """pretrain.py's entry for --memory-preflight: bad input is one line and exit 2."""
    rest, capacity, json_path, dry_run = [], None, None, False
    it = iter(argv)
    try:
        for arg in it:
            if arg == "--memory-preflight":
                continue
            if arg == "--memory-dry-run":
                dry_run = True
                continue
            if arg == "--memory-preflight-json" or arg.startswith("--memory-preflight-json="):
                json_path = _json_path(arg.split("=", 1)[1] if "=" in arg else next(it, None))
                continue
            if arg == "--device-memory-gb" or arg.startswith("--device-memory-gb="):
                value = arg.split("=", 1)[1] if "=" in arg else next(it, None)
                try:
                    capacity = float(value)
                    check_value("--device-memory-gb", capacity)
                except (TypeError, ValueError):  # ConfigError is a ValueError
                    raise ConfigError(
                        "--device-memory-gb", f"must be {RANGES['--device-memory-gb']} (GB), got {value!r}"
                    ) from None
                continue
            rest.append(arg)
        if capacity is None:
            raise ConfigError("--memory-preflight", "needs --device-memory-gb (the GPU's memory)")
    except ConfigError as err:
        print(f"pretrain.py: error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        code = preflight(rest, capacity, json_path=json_path, dry_run=dry_run)
    except ConfigError as err:
        print(f"pretrain.py: error: {err}", file=sys.stderr)
        return 2
    except WriteFailedError as err:
        print(f"pretrain.py: error: {err}", file=sys.stderr)
        return 1
    except DryRunError as err:
        print(f"pretrain.py: error: --memory-dry-run: {err}", file=sys.stderr)
        return 1
    print(f" (preflight took {time.perf_counter() - start:.2f} s)")
    return code
