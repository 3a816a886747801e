"""What a run wrote to TensorBoard, read back from its event files."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars(logdir) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
