"""The pipeline schedule played over a stage's model chunks: its forwards and backwards in order
(``core/pipeline_parallel/schedule_order.forward_backward_order``, the schedules' own), the saved
activations they hold (:func:`schedule_peak`) and the allocated
bytes beyond the static ones at each instant (:func:`schedule_peak_allocated`, with each chunk's
transients from predict/temporaries.py)."""

from __future__ import annotations

from megatron_lite.training.memory.predict.activations import ChunkActivations
from megatron_lite.training.memory.predict.temporaries import ChunkTransients


def schedule_peak(events: list[tuple[str, int]], chunks: list[ChunkActivations]) -> tuple[int, int]:
    """(peak saved bytes, most microbatch-chunks in flight) over the schedule's events."""
    held = peak = in_flight = most = 0
    for kind, c in events:
        if kind == "F":
            held += chunks[c].kept
            in_flight += 1
            peak, most = max(peak, held), max(most, in_flight)
        else:
            peak = max(peak, held - chunks[c].kept + chunks[c].peak)
            held -= chunks[c].kept
            in_flight -= 1
    return peak, most


def schedule_peak_allocated(
    events: list[tuple[str, int]],
    chunks: list[ChunkActivations],
    transients: list[ChunkTransients],
) -> tuple[int, int]:
    """(the most bytes beyond the static ones over the schedule's forwards and backwards, the saved
    activations then): the saves of the microbatch-chunks in flight plus the transients of the one
    running. A received input is among its chunk's saves (the first norm saves it)."""
    held = saved = 0
    peak = (0, 0)
    for kind, c in events:
        if kind == "F":
            instant = transients[c].forward
            peak = max(peak, (held + instant[0], saved + instant[1]))
            held, saved = held + chunks[c].kept, saved + chunks[c].kept
        else:
            instant = transients[c].backward
            base, base_saved = held - chunks[c].kept, saved - chunks[c].kept
            peak = max(peak, (base + instant[0], base_saved + instant[1]))
            held, saved = base, base_saved
    return peak
