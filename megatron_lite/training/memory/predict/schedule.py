"""The pipeline schedule played over a stage's model chunks: its forwards and backwards in order
(:func:`schedule_events`), the saved activations they hold (:func:`schedule_peak`) and the allocated
bytes beyond the static ones at each instant (:func:`schedule_peak_allocated`, with each chunk's
transients from predict/temporaries.py)."""

from __future__ import annotations

from megatron_lite.core.pipeline_parallel.interleaved import get_pp_rank_microbatches, get_schedule_table
from megatron_lite.training.memory.predict.activations import ChunkActivations
from megatron_lite.training.memory.predict.temporaries import ChunkTransients


def schedule_events(num_microbatches: int, vp: int, pp: int, rank: int, group: int) -> list[tuple[str, int]]:
    """The schedule's forwards and backwards on ``rank`` in order, as ("F" | "B", model chunk): plain
    1F1B (``vp`` 1) or interleaved, with the same warmup and steady-state order as the schedules."""
    total, _, warmup, remaining = get_pp_rank_microbatches(num_microbatches, vp, group, pp, rank)
    if vp == 1:
        warmup = min(pp - rank - 1, num_microbatches)
        remaining = num_microbatches - warmup
    table = get_schedule_table(num_microbatches, vp, group)
    events = [("F", table[k][1]) for k in range(warmup)]
    for k in range(warmup, warmup + remaining):
        events.append(("F", table[k][1]))
        events.append(("B", vp - 1 - table[k - warmup][1]))
    events += [("B", vp - 1 - table[k][1]) for k in range(remaining, total)]
    return events


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
