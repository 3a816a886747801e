"""A run's logged per-stage figures (``--log-memory-per-pp-stage``: ``memory/pp-stage-<i>/<name>``, in
GB) as stage bars: the predicted peak's parts from the ``predicted-*`` names the writer logs at start,
the measured allocated peak beside."""

from __future__ import annotations

from megatron_lite.training.memory.picture.bars import PARTS, StageBars
from megatron_lite.training.memory.predict.stages import ADAPTER_WEIGHTS_KEY, PREDICTED_KEYS

MEASURED_PEAK = "mem-max-allocated-gigabytes"
PREDICTED_PEAK = PREDICTED_KEYS["peak_bytes"]
# The picture's parts -> the logged names they are read from; the activations are what the peak
# leaves (the preflight table's act column), so the parts sum to the logged peak.
LOGGED_PARTS = {
    "weights": PREDICTED_KEYS["weights_bytes"],
    "adapters": ADAPTER_WEIGHTS_KEY,
    "grads": PREDICTED_KEYS["grads_bytes"],
    "optimizer": PREDICTED_KEYS["optimizer_state_bytes"],
    "temporaries": PREDICTED_KEYS["temporaries_bytes"],
}


def stage_bars_from_logged(figures: dict[str, dict[int, float]]) -> list[StageBars]:
    """One StageBars per stage that logged its allocated peak or its predicted peak, from
    ``{name: {stage: GB}}`` (a prediction's logged value, the measured peak's maximum over the run)."""

    def nbytes(name: str, stage: int) -> int | None:
        value = figures.get(name, {}).get(stage)
        return None if value is None else round(value * 1e9)

    stages = sorted(set(figures.get(MEASURED_PEAK, {})) | set(figures.get(PREDICTED_PEAK, {})))
    bars = []
    for stage in stages:
        parts = {}
        if (peak := nbytes(PREDICTED_PEAK, stage)) is not None:
            values = {part: nbytes(name, stage) for part, name in LOGGED_PARTS.items()}
            values = {part: v for part, v in values.items() if v is not None}
            if "adapters" in values:  # LoRA: the logged weights include the adapters'
                values["weights"] = values.get("weights", 0) - values["adapters"]
            values["activations"] = max(peak - sum(values.values()), 0)
            parts = {part: values[part] for part in PARTS if part in values}
        bars.append(StageBars(stage, parts, nbytes(MEASURED_PEAK, stage), "measured"))
    return bars
