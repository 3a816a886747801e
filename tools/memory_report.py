#!/usr/bin/env python
"""Summarise the memory a run logged to TensorBoard.

    python tools/memory_report.py TENSORBOARD_DIR [--png FILE] [--html FILE]

For every memory metric: its peak over the run, which pipeline stage holds it (needs a run with
--log-memory-per-pp-stage; otherwise the logged value is already the pipeline-wide max and the stage is
unknown) and the headroom left where the device capacity was logged (CUDA runs). Then, for each stage
and each quantity the run both measured and predicted (``memory/pp-stage-<i>/predicted-*``, logged at
start from theoretical_memory): the measured peak, the prediction and the prediction's error in %.
With --png, plots each metric over iterations, one line per stage (needs matplotlib:
pip install 'megatron_lite[plot]').
With --html, the memory picture (megatron_lite/training/memory/picture/): per stage the predicted
allocated peak as stacked parts, the measured allocated peak (its maximum over the run) beside it,
and the device capacity and usable lines where the capacity was logged; one self-contained page
(render it with tools/render_html.py). Needs a run with --log-memory-per-pp-stage.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_lite.training.memory.picture.logged import MEASURED_PEAK, PREDICTED_PEAK  # noqa: E402
from megatron_lite.training.memory.pipeline import HEADLINE_NAMES  # noqa: E402

STAGE_TAG = re.compile(r"^memory/pp-stage-(\d+)/(.+)$")
PREDICTED = "predicted-"  # predicted-<quantity>-gigabytes sits beside the measured mem-<quantity>-gigabytes
CAPACITY = "memory/capacity-gigabytes"


def load_memory_scalars(logdir: str) -> tuple[dict, dict, dict]:
    """(pipeline max series, per-stage series, capacity series) keyed by metric name; each series is
    a sorted list of (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    pipeline, stages, capacity = {}, defaultdict(dict), []
    for tag in acc.Tags().get("scalars", []):
        if not tag.startswith("memory/"):
            continue
        series = sorted((e.step, e.value) for e in acc.Scalars(tag))
        if tag == CAPACITY:
            capacity = series
        elif m := STAGE_TAG.match(tag):
            stages[m.group(2)][int(m.group(1))] = series
        else:
            pipeline[tag[len("memory/") :]] = series
    return pipeline, dict(stages), capacity


def split_predictions(stages: dict) -> tuple[dict, dict]:
    """(measured per-stage series, predicted per-stage series), each keyed by metric name."""
    measured = {k: v for k, v in stages.items() if not k.startswith(PREDICTED)}
    return measured, {k: v for k, v in stages.items() if k.startswith(PREDICTED)}


def compare(stages: dict, predicted: dict) -> list[dict]:
    """One row per stage and quantity with both a measurement (its peak over the run) and a
    prediction (the latest logged): measured, predicted, error % of the prediction."""
    rows = []
    for name in sorted(predicted):
        measured_name = "mem-" + name[len(PREDICTED) :]
        for stage, series in sorted(predicted[name].items()):
            measured_series = stages.get(measured_name, {}).get(stage)
            if not measured_series:
                continue
            measured = max(v for _, v in measured_series)
            guess = series[-1][1]
            error = 100.0 * (guess - measured) / measured if measured else None
            rows.append(
                {
                    "stage": stage,
                    "metric": measured_name,
                    "measured": measured,
                    "predicted": guess,
                    "error": error,
                }
            )
    return sorted(rows, key=lambda r: (r["stage"], r["metric"]))


def print_comparison(rows: list[dict], out=sys.stdout) -> None:
    print("\nmeasured vs predicted (theoretical_memory; a prediction, not a measurement):", file=out)
    print(f"{'stage':<10}{'metric':<36}{'measured':>12}{'predicted':>12}{'error %':>10}", file=out)
    for r in rows:
        error = f"{r['error']:+.2f}" if r["error"] is not None else "n/a"
        print(
            f"{'pp ' + str(r['stage']):<10}{r['metric']:<36}{r['measured']:>12.6g}{r['predicted']:>12.6g}{error:>10}",
            file=out,
        )


def summarize(pipeline: dict, stages: dict, capacity: list) -> list[dict]:
    rows = []
    cap = max((v for _, v in capacity), default=None)
    headline = next((n for n in HEADLINE_NAMES if n in pipeline), None)
    for name in sorted(set(pipeline) | set(stages)):
        if name in ("peak-stage", "pp-imbalance"):
            continue  # not memory: they say where the headline peak is, in its row
        per_stage = stages.get(name, {})
        if per_stage:
            stage, (step, peak) = max(
                ((s, max(ser, key=lambda e: e[1])) for s, ser in per_stage.items()), key=lambda x: x[1][1]
            )
        else:
            stage, (step, peak) = None, max(pipeline[name], key=lambda e: e[1])
            if name == headline and "peak-stage" in pipeline:
                # The writer logged which stage held the headline peak at each step (memory/peak-stage).
                held_by = dict(pipeline["peak-stage"])
                stage = int(held_by[step]) if step in held_by else None
        headroom = cap - peak if cap is not None and "gigabytes" in name else None
        rows.append({"metric": name, "peak": peak, "step": step, "stage": stage, "headroom": headroom})
    return rows


def print_table(rows: list[dict], out=sys.stdout) -> None:
    print(f"{'metric':<36}{'peak':>12}{'at step':>9}  {'stage':<28}{'headroom (GB)':>14}", file=out)
    for r in rows:
        stage = f"pp stage {r['stage']}" if r["stage"] is not None else "n/a (no --log-memory-per-pp-stage)"
        headroom = f"{r['headroom']:.3f}" if r["headroom"] is not None else "unknown"
        print(f"{r['metric']:<36}{r['peak']:>12.6g}{r['step']:>9}  {stage:<28}{headroom:>14}", file=out)


def plot(pipeline: dict, stages: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(set(pipeline) | set(stages))
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for stage, series in sorted(stages.get(name, {}).items()):
            ax.plot([s for s, _ in series], [v for _, v in series], label=f"stage {stage}")
        if name in pipeline:
            ax.plot(
                [s for s, _ in pipeline[name]], [v for _, v in pipeline[name]], "k--", label="pipeline max"
            )
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def stage_figures(measured: dict, predicted: dict) -> dict[str, dict[int, float]]:
    """``{name: {stage: GB}}``: each measured quantity's peak over the run, each prediction's latest."""
    figures = {name: {s: max(v for _, v in ser) for s, ser in per.items()} for name, per in measured.items()}
    figures.update({name: {s: ser[-1][1] for s, ser in per.items()} for name, per in predicted.items()})
    return figures


def write_html(path: str, logdir: str, measured: dict, predicted: dict, capacity: list) -> None:
    """The memory picture of the run in ``logdir``."""
    from megatron_lite.training.memory.picture import MemoryPanel, size_text, write_memory_page
    from megatron_lite.training.memory.picture.logged import stage_bars_from_logged

    bars = stage_bars_from_logged(stage_figures(measured, predicted))
    cap = max((v for _, v in capacity), default=None)
    lines = []
    for s in bars:
        if s.parts and s.measured_peak_bytes:
            error = 100 * (s.predicted_peak_bytes / s.measured_peak_bytes - 1)
            lines.append(
                f"stage {s.stage}: measured allocated peak {size_text(s.measured_peak_bytes)}, "
                f"predicted {size_text(s.predicted_peak_bytes)} ({error:+.1f}%)"
            )
    if cap is None:
        lines.append("device capacity not logged (a CPU run): no capacity line")
    panel = MemoryPanel(
        f"memory per pipeline stage of {os.path.basename(os.path.normpath(logdir))}",
        bars,
        round(cap * 1e9) if cap is not None else None,
        lines=tuple(lines),
    )
    notes = (
        f"From the TensorBoard events in {logdir}. Stacked: the predicted allocated peak "
        "(memory/pp-stage-<i>/predicted-*, logged at start: a prediction, not a measurement); grey: "
        "mem-max-allocated-gigabytes, the measured allocated peak over the run, temporaries included.",
    )
    write_memory_page(path, "Memory per pipeline stage: predicted and measured", [panel], notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Peak memory per metric and stage from TensorBoard events.")
    parser.add_argument("logdir", help="the run's --tensorboard-dir")
    parser.add_argument("--png", help="write a plot of memory over iterations, one line per stage")
    parser.add_argument(
        "--html",
        help="write the memory picture: per stage the predicted peak's parts beside the measured peak",
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.logdir):
        print(f"memory_report.py: error: {args.logdir} is not a directory", file=sys.stderr)
        return 2
    pipeline, stages, capacity = load_memory_scalars(args.logdir)
    if not pipeline and not stages:
        print(
            f"memory_report.py: error: no memory/* scalars in {args.logdir}; "
            "was the run started with --log-memory-to-tensorboard?",
            file=sys.stderr,
        )
        return 2
    stages, predicted = split_predictions(stages)
    if args.html and not {MEASURED_PEAK, PREDICTED_PEAK} & (set(stages) | set(predicted)):
        print(
            f"memory_report.py: error: --html needs per-stage metrics in {args.logdir}; "
            "was the run started with --log-memory-per-pp-stage?",
            file=sys.stderr,
        )
        return 2
    print_table(summarize(pipeline, stages, capacity))
    if comparison := compare(stages, predicted):
        print_comparison(comparison)
    if args.png:
        try:
            plot(pipeline, stages, args.png)
        except ImportError:
            print(
                "memory_report.py: error: --png needs matplotlib: pip install 'megatron_lite[plot]'",
                file=sys.stderr,
            )
            return 2
        print(f"plot written to {args.png}")
    if args.html:
        try:
            write_html(args.html, args.logdir, stages, predicted, capacity)
        except OSError as err:  # WriteFailedError: one line, the path and why
            print(f"memory_report.py: error: {err}", file=sys.stderr)
            return 2
        print(f"page written to {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
