"""The memory tables per pipeline stage: the end-of-run one (each stage's measured parts and allocated
peak beside its prediction) and the preflight's (the predicted parts, peak and headroom on a device).

Short column names in one unit chosen for the sizes (MiB below a GiB, else GiB; the preflight's in GB),
3 significant digits, so the table fits 120 columns; the dashboards keep the full tag names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_lite.training.memory.pipeline import gather_memory_across_pp_group
from megatron_lite.training.memory.predict.stages import predict_memory_per_stage
from megatron_lite.training.memory.report import _cuda_in_use, report_memory
from megatron_lite.utils.common_utils import print_rank_last

if TYPE_CHECKING:
    from megatron_lite.training.config import ConfigContainer

# Column -> the measured name in the memory report (gigabytes, 1e9 bytes).
COLUMNS = {
    "weights": "mem-weights-gigabytes",
    "adapters": "mem-adapter-weights-gigabytes",  # LoRA: the adapters' part of the weights
    "grads": "mem-grads-gigabytes",
    "optim": "mem-optimizer-state-gigabytes",
    "act": "mem-max-activation-gigabytes",
    "temp": "mem-temporaries-gigabytes",
    "peak": "mem-max-allocated-gigabytes",
}


def choose_unit(largest_bytes: float) -> tuple[str, int]:
    """("MiB", 2**20) for sizes under a GiB, else ("GiB", 2**30)."""
    return ("MiB", 2**20) if largest_bytes < 2**30 else ("GiB", 2**30)


def three_digits(value: float) -> str:
    """``value`` to 3 significant digits, without an exponent from 0.001 to 9999 (the unit keeps sizes
    there)."""
    text = f"{value:#.3g}".rstrip(".")  # '#': 46 shows as 46.0, 3 digits
    return f"{value:.0f}" if "e+" in text else text


def format_memory_table(stages: list[dict], peak_bytes_predicted: list[int], rss_name: str | None) -> str:
    """The table from each stage's report (names as logged, in GB) and its predicted allocated peak."""
    columns = {k: v for k, v in COLUMNS.items() if any(v in s for s in stages)}
    if rss_name:
        columns["rss"] = rss_name
    sizes = [s[n] * 1e9 for s in stages for n in columns.values() if n in s] + list(peak_bytes_predicted)
    unit, scale = choose_unit(max(sizes, default=0))
    header = f"{'stage':>5}" + "".join(f"{c:>9}" for c in columns) + f"{'pred':>9}{'err%':>7}"
    rows = [header]
    for i, (s, predicted) in enumerate(zip(stages, peak_bytes_predicted)):
        cells = "".join(f"{three_digits(s[n] * 1e9 / scale) if n in s else '-':>9}" for n in columns.values())
        measured = s.get(COLUMNS["peak"])
        error = f"{round(100 * (predicted / (measured * 1e9) - 1), 1) or 0.0:+.1f}" if measured else "-"
        rows.append(f"{i:>5}{cells}{three_digits(predicted / scale):>9}{error:>7}")
    title = (
        f" memory per pipeline stage ({unit}; peak: measured allocated peak, temporaries included;"
        " pred: predicted)"
    )
    return "\n".join([title, *rows])


def format_preflight_table(predictions, capacity_gb: float, dry=None, balanced=None) -> str:
    """Per stage, in GB (3 significant digits): the static parts, the saved activations and the
    temporaries at the predicted peak, the peak, the device's headroom above it; with ``dry`` (the dry
    run's StageDryRun list) the dry run's measured peak and its difference from the prediction; with
    ``balanced`` (a MoE model's predictions under balanced routing, when ``predictions`` are the
    worst routing's) balanced routing's peak. With LoRA an ``adapters`` column: the adapters' part of
    the weights (the grads and optim columns are theirs alone: the frozen base has neither)."""
    lora = any(p.adapter_weights_bytes for p in predictions)
    columns = (
        ("weights",) + (("adapters",) if lora else ()) + ("grads", "optim", "act", "temp", "peak", "headroom")
    )
    columns += ("dry run", "diff%") if dry else ()
    columns += ("balanced",) if balanced else ()
    title = "   (GB; predicted" + ("; dry run: measured on fake tensors" if dry else "")
    title += "; MoE: worst routing, balanced routing's peak beside)" if balanced else ")"
    rows = [f"{'stage':>5}" + "".join(f"{c:>9}" for c in columns) + title]
    for i, p in enumerate(predictions):
        values = (
            p.weights_bytes,
            *((p.adapter_weights_bytes,) if lora else ()),
            p.grads_bytes,
            p.optimizer_state_bytes,
            preflight_activation_bytes(p),
            p.temporaries_bytes,
            p.peak_bytes,
        )
        cells = [three_digits(v / 1e9) for v in values] + [three_digits(capacity_gb - p.peak_bytes / 1e9)]
        if dry:
            measured = dry[i].max_allocated_bytes
            cells += [three_digits(measured / 1e9), f"{100 * (p.peak_bytes / measured - 1):+.1f}"]
        if balanced:
            cells.append(three_digits(balanced[i].peak_bytes / 1e9))
        rows.append(f"{i:>5}" + "".join(f"{c:>9}" for c in cells))
    return "\n".join(rows)


def preflight_activation_bytes(p) -> int:
    """What the preflight's ``act`` column shows: the peak less the static parts and the temporaries."""
    return p.peak_bytes - p.weights_bytes - p.grads_bytes - p.optimizer_state_bytes - p.temporaries_bytes


def print_memory_table(config: ConfigContainer, pg_collection) -> None:
    """Each stage's final memory report as a table on the last rank, beside the predicted peak.
    Collective over the pp group."""
    _, stages = gather_memory_across_pp_group(report_memory(config.logger.memory_keys), pg_collection.pp)
    # The table shows the last rank's pipeline: predict for its dp x cp rank, on its device.
    dp_cp = pg_collection.dp_cp
    device_type = "cuda" if _cuda_in_use() else "cpu"
    predictions = predict_memory_per_stage(config, 0 if dp_cp is None else dist.get_rank(dp_cp), device_type)
    rss = "mem-max-rss-gigabytes" if "mem-max-rss-gigabytes" in stages[0] else None
    print_rank_last(format_memory_table(stages, [p.peak_bytes for p in predictions], rss))
    if any(p.activation_bytes_worst for p in predictions):  # MoE, routed rows not fixed by the config
        parts = ", ".join(
            f"stage {p.pp_rank} {p.activation_bytes / 2**20:.3g} / {p.activation_bytes_worst / 2**20:.3g}"
            for p in predictions
        )
        print_rank_last(f" MoE predicted act (MiB, balanced routing / worst-routing bound): {parts}")
