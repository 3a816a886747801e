"""Will it fit? The per-stage memory prediction for an exact command line, before any GPU hour is spent.

    python pretrain.py ... --memory-preflight --device-memory-gb 80

Builds no world and trains nothing: predicts each pipeline stage's weights, gradients, optimizer state,
peak activations, the temporaries alive at its peak and so its allocated peak for the layout as given
(predict/stages.py), prints them beside the device's memory, names the first stage expected to run
out, and searches the memory levers (levers.py) for the cheapest change that makes every stage fit.
``--memory-preflight-json FILE`` also writes all of it as JSON (atomically), for CI jobs and notebooks;
``--memory-preflight-html FILE`` draws it (training/memory/picture/: each stage's stacked parts, the dry
run's measured peak beside them, the device and the reserve) on one self-contained page.
Exit 0 when it fits, 1 when it does not, 2 on bad input.

A stage fits when its predicted allocated peak leaves ``RESERVE_FRACTION`` of the device free. The peak
counts every tensor the step allocates, temporaries included (the same figure as
``mem-max-allocated-bytes``, checked against CPU runs within 3%); the reserve is for what a GPU adds that
no tensor shows: the CUDA context and kernels (0.5-1 GB), NCCL's communication buffers (hundreds of MB
per communicator), and the caching allocator's block rounding and fragmentation (``mem-max-reserved``
over ``mem-max-allocated``, typically a few percent, more with varying shapes).

A MoE model whose routed rows are open (no capacity factor with padding) is judged on the worst
routing's bound, with balanced routing's figures beside: balanced routing holds only while load
balancing does, and a job that fits only under it runs out once routing skews (Megatron-LM issue
#1445, "OOMs after a few hundred steps"). The lever search judges every candidate the same way.
"""

from __future__ import annotations

import json
import sys
import time
import warnings

from megatron_lite.run_modes.dry_run import DryRunError, dry_run_stages
from megatron_lite.run_modes.preflight_json import (
    RESERVE_FRACTION,
    json_path_arg,
    judged_predictions,
    preflight_record,
    stage_fits,
    stage_peaks,
    usable_gb,
)
from megatron_lite.training.arguments import config_from_argv
from megatron_lite.training.cli.ranges import RANGES, check_value
from megatron_lite.training.errors import ConfigError
from megatron_lite.training.memory.levers import candidate_changes
from megatron_lite.training.memory.predict.lora import lora_of
from megatron_lite.training.memory.predict.moe import judged_routing
from megatron_lite.training.memory.table import format_preflight_table
from megatron_lite.utils.atomic_io import WriteFailedError, atomic_write_bytes

ROUTING_NOTES = {"worst": ", worst routing", "exact": ", rows fixed by the padded capacity"}
PREFLIGHT_FLAGS = (
    "--memory-preflight",
    "--device-memory-gb",
    "--memory-preflight-json",
    "--memory-preflight-html",
    "--memory-dry-run",
)


def _config(argv: list[str]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_from_argv(argv)


def _gb(num_bytes: float) -> float:
    return num_bytes / 1e9


def _recommend(argv: list[str], config, capacity_gb: float, margin: float = 1.0):
    """The cheapest change that makes every stage fit, with the predictions and the config under it;
    (None, None, None) when no combination of the levers does. ``margin``: how much more than
    predicted the dry run measured (at least 1), which a candidate's predictions must leave room for."""
    usable = usable_gb(capacity_gb)
    for change in candidate_changes(config):
        try:
            candidate = _config([*argv, *change.flags])
        except (ConfigError, ValueError, AssertionError):
            continue
        after, _ = judged_predictions(candidate)  # a MoE candidate judged as the job is: its worst routing
        if all(_gb(p.peak_bytes * margin) <= usable for p in after):
            return change, after, candidate
    return None, None, None


def _verdict(predictions, capacity_gb: float, dry, out, balanced=None) -> list[bool]:
    fits, peaks = stage_fits(predictions, capacity_gb, dry), stage_peaks(predictions, dry)
    usable = usable_gb(capacity_gb)
    which = "predicted or dry run, the larger" if dry else "predicted"
    routing = " under worst routing" if balanced else ""

    def beside(i: int) -> str:  # balanced routing's figure beside the judged one
        return f"; {_gb(balanced[i].peak_bytes):.2f} GB under balanced routing" if balanced else ""

    if all(fits):
        peak = max(range(len(peaks)), key=lambda i: peaks[i])
        print(
            f" verdict: fits{routing}; the peak is stage {peak}'s {_gb(peaks[peak]):.2f} GB ({which}{beside(peak)})",
            file=out,
        )
    else:
        failing = [i for i, ok in enumerate(fits) if not ok]
        first = max(failing, key=lambda i: (peaks[i], -i))
        print(
            f" verdict: does not fit{routing}: stage {first} runs out first ({which} {_gb(peaks[first]):.2f} GB > "
            f"{usable:g} GB{beside(first)}); stages that do not fit: {', '.join(map(str, failing))}",
            file=out,
        )
    return fits


def lora_line(lora, predictions) -> str:
    """What the table's columns hold of LoRA's parts: the frozen base's weights, the adapters' weights,
    gradients, optimizer state and saved activations."""
    per_layer = max(p.adapter_activation_bytes_per_layer_microbatch for p in predictions)
    targets = ", ".join(lora.target_modules) if lora.target_modules else "every linear"
    return (
        f" LoRA (rank {lora.dim}, alpha {lora.alpha}, on {targets}): the base's weights are frozen, with no "
        "gradient buffer, fp32 master or optimizer state; the adapters' weights are the adapters column "
        f"(part of weights), grads and optim are theirs alone, and their saves are {per_layer / 2**20:.3g} MiB "
        "per layer and microbatch (part of act)"
    )


def _report_change(change, after, candidate, out) -> None:
    """The recommendation line: the flags, why, their price and the predicted peak with them."""
    peak = max(range(len(after)), key=lambda i: after[i].peak_bytes)
    routing = judged_routing(candidate.model)
    quality = f"; {change.quality_note}" if change.quality and change.quality_note else ""
    print(
        f" cheapest change that fits every stage: {' '.join(change.flags)}  ({change.why}; about "
        f"{change.cost:.0%} more time per step{quality}; predicted peak {_gb(after[peak].peak_bytes):.2f} GB "
        f"on stage {peak}{ROUTING_NOTES.get(routing, '')})",
        file=out,
    )


def preflight(
    argv: list[str],
    capacity_gb: float,
    out=sys.stdout,
    json_path: str | None = None,
    dry_run: bool = False,
    html_path: str | None = None,
) -> int:
    """Print the prediction and verdict for ``argv`` (pretrain.py's flags without the preflight's);
    with ``dry_run``, also each stage's dry run (dry_run/), and confirm the recommended change with
    one; with ``json_path``, also write them there (atomically); with ``html_path``, the picture."""
    config = _config(argv)
    m = config.model
    predictions, balanced = judged_predictions(config)
    layout = (
        f"tp {m.tensor_model_parallel_size} x pp {m.pipeline_model_parallel_size} x cp "
        f"{m.context_parallel_size} x dp {config.data_parallel_size}, vp "
        f"{m.virtual_pipeline_model_parallel_size or 1}, {config.num_microbatches} microbatches of "
        f"{config.train.micro_batch_size}"
    )
    if m.num_moe_experts:
        layout += f"; {m.num_moe_experts} experts, ep {m.expert_model_parallel_size}"
    dry = dry_run_stages(config, "cuda", out, "the job as given") if dry_run else None
    how = "predicted, and measured by the dry run" if dry else "a prediction: no world built, nothing trained"
    print(f" memory preflight ({layout}; {how})", file=out)
    print(format_preflight_table(predictions, capacity_gb, dry, balanced), file=out)
    usable = usable_gb(capacity_gb)
    print(
        f" device: {capacity_gb:g} GB, of which {usable:g} GB for the predicted tensors "
        f"({RESERVE_FRACTION:.0%} kept for the CUDA context, NCCL buffers, the allocator's rounding and fragmentation)",
        file=out,
    )
    if lora := lora_of(config):
        print(lora_line(lora, predictions), file=out)
    if balanced:
        print(
            " MoE routing is open (no --moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity): "
            "judged on the worst routing's bound, every token of the expert group sent to this rank's experts; "
            "a job that fits only under balanced routing runs out once routing skews",
            file=out,
        )
    fits = _verdict(predictions, capacity_gb, dry, out, balanced)
    recommendation, confirmed = ("" if all(fits) else None), None
    if not all(fits):
        margin = max([1.0] + [d.max_allocated_bytes / p.peak_bytes for p, d in zip(predictions, dry or [])])
        change, after, candidate = _recommend(argv, config, capacity_gb, margin)
        if change is None:
            print(
                " no combination of the memory levers makes every stage fit: a smaller micro-batch or model",
                file=out,
            )
        else:
            recommendation = " ".join(change.flags)
            _report_change(change, after, candidate, out)
            if dry_run:  # the lever search's answer, measured
                measured = dry_run_stages(candidate, "cuda", out, "the job with the change")
                confirmed = all(stage_fits(after, capacity_gb, measured))
                top = max(measured, key=lambda d: d.max_allocated_bytes)
                print(
                    f" the dry run {'confirms' if confirmed else 'does NOT confirm'} it: peak "
                    f"{_gb(top.max_allocated_bytes):.2f} GB on stage {top.pp_rank}",
                    file=out,
                )
    if json_path is not None:
        record = preflight_record(
            predictions, capacity_gb, all(fits), recommendation, dry, confirmed, balanced, judged_routing(m)
        )
        text = (json.dumps(record, indent=2) + "\n").encode()
        atomic_write_bytes(json_path, lambda f: f.write(text), needed=len(text))
        print(f" wrote {json_path}", file=out)
    if html_path is not None:
        _write_picture(html_path, layout, predictions, capacity_gb, dry, fits)
        print(f" wrote {html_path}", file=out)
    return 0 if all(fits) else 1


def _write_picture(path: str, layout: str, predictions, capacity_gb: float, dry, fits) -> None:
    """--memory-preflight-html: one panel, the job's stages (the dry run's measured peak beside each)."""
    from megatron_lite.training.memory.picture import (
        MemoryPanel,
        stage_bars_from_predictions,
        write_memory_page,
    )

    verdict = (
        "fits"
        if all(fits)
        else f"does not fit: stages {', '.join(str(i) for i, ok in enumerate(fits) if not ok)}"
    )
    panel = MemoryPanel(
        title=layout,
        stages=stage_bars_from_predictions(predictions, dry),
        capacity_bytes=int(capacity_gb * 1e9),
        reserve_fraction=RESERVE_FRACTION,
        lines=(f"verdict: {verdict}", "predicted" + (", and measured by the dry run" if dry else "")),
    )
    write_memory_page(path, "memory preflight", [panel])


def main(argv: list[str]) -> int:
    """pretrain.py's entry for --memory-preflight: bad input is one line and exit 2."""
    rest, capacity, json_path, html_path, dry_run = [], None, None, None, False
    it = iter(argv)
    try:
        for arg in it:
            if arg == "--memory-preflight":
                continue
            if arg == "--memory-dry-run":
                dry_run = True
                continue
            if arg == "--memory-preflight-json" or arg.startswith("--memory-preflight-json="):
                json_path = json_path_arg(arg.split("=", 1)[1] if "=" in arg else next(it, None))
                continue
            if arg == "--memory-preflight-html" or arg.startswith("--memory-preflight-html="):
                value = arg.split("=", 1)[1] if "=" in arg else next(it, None)
                html_path = json_path_arg(value, "--memory-preflight-html")
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
        code = preflight(rest, capacity, json_path=json_path, dry_run=dry_run, html_path=html_path)
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
