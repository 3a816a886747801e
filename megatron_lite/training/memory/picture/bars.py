"""What a memory picture shows: each stage's peak split into parts, the measured peak beside it, and
the device's capacity and reserve. Plain data, so the preflight, the planner and tools/memory_report.py
fill it from their own figures."""

from __future__ import annotations

from dataclasses import dataclass

# The stacked parts, bottom to top: static first (they sit in memory the whole step), then what the
# step adds at the peak. The page colours and orders the bars by this tuple.
PARTS = ("weights", "adapters", "grads", "optimizer", "activations", "temporaries")


@dataclass(frozen=True)
class StageBars:
    """One pipeline stage: its predicted peak's parts (bytes, keys from :data:`PARTS`) and, when a run
    or a dry run measured it, the measured allocated peak."""

    stage: int
    parts: dict[str, int]
    measured_peak_bytes: int | None = None
    measured_label: str = "measured"
    """"measured" (a run's allocated peak) or "dry run" (measured on fake tensors)."""

    @property
    def predicted_peak_bytes(self) -> int:
        """The parts' sum: the predicted allocated peak."""
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryPanel:
    """One chart: a layout's stages, the device capacity (None when unknown: no lines drawn), the
    fraction of it kept in reserve, and a few lines of text shown under the chart."""

    title: str
    stages: list[StageBars]
    capacity_bytes: int | None = None
    reserve_fraction: float = 0.10
    lines: tuple[str, ...] = ()

    @property
    def usable_bytes(self) -> int | None:
        """capacity x (1 - reserve): the most a stage's peak may reach."""
        if self.capacity_bytes is None:
            return None
        return int(self.capacity_bytes * (1 - self.reserve_fraction))


def prediction_parts(p) -> dict[str, int]:
    """A StageMemoryPrediction's allocated peak as parts summing to ``peak_bytes``: the frozen base's
    and the adapters' weights (LoRA), gradient buffers, optimizer state, the activations saved at the
    peak and the temporaries then live (the preflight table's columns)."""
    static = p.weights_bytes + p.grads_bytes + p.optimizer_state_bytes
    parts = {
        "weights": p.weights_bytes - p.adapter_weights_bytes,
        "adapters": p.adapter_weights_bytes,
        "grads": p.grads_bytes,
        "optimizer": p.optimizer_state_bytes,
        "activations": p.peak_bytes - static - p.temporaries_bytes,
        "temporaries": p.temporaries_bytes,
    }
    if not p.adapter_weights_bytes:
        del parts["adapters"]  # not a LoRA run: no adapters in the legend
    return parts


def stage_bars_from_predictions(predictions, dry=None) -> list[StageBars]:
    """One StageBars per StageMemoryPrediction, with the dry run's measured peak beside it when ``dry``
    (a StageDryRun list in stage order) is given."""
    bars = []
    for i, p in enumerate(predictions):
        measured = dry[i].max_allocated_bytes if dry else None
        bars.append(StageBars(p.pp_rank, prediction_parts(p), measured, "dry run" if dry else "measured"))
    return bars
