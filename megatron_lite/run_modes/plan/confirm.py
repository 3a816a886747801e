"""The top of the ranking, confirmed by the dry run (dry_run/): each listed layout's stages run at full
scale on fake tensors; a layout whose dry run does not fit (judged as the preflight judges it: the
larger of the prediction and the measurement, with the reserve) is dropped and the next one tried."""

from __future__ import annotations

import time

from megatron_lite.run_modes.dry_run import dry_run_stages
from megatron_lite.run_modes.preflight_json import judged_predictions, stage_fits

# A stage's dry run and prediction agree when they differ by at most this share of the prediction.
AGREEMENT = 0.02


def distinct_grids(fitting: list, count: int | None = None) -> list:
    """The best of each (tp, pp, cp, ep) in rank order: the vp and lever variants of one split are
    one entry (the first); ``count`` caps the list."""
    seen, listed = set(), []
    for candidate in fitting:
        lay = candidate.layout
        key = (lay.tp, lay.pp, lay.cp, lay.ep)
        if key not in seen:
            seen.add(key)
            listed.append(candidate)
    return listed if count is None else listed[:count]


def stage_differences(candidate) -> list[float]:
    """Per stage: (dry run - prediction) / prediction."""
    return [
        (d.max_allocated_bytes - p.peak_bytes) / p.peak_bytes
        for p, d in zip(candidate.predictions, candidate.dry)
    ]


def agrees(candidate) -> bool:
    """Whether every stage's dry run is within :data:`AGREEMENT` of its prediction."""
    return all(abs(x) <= AGREEMENT for x in stage_differences(candidate))


def exactly(candidate, capacity_gb: float) -> None:
    """Predict ``candidate`` again over all the step's microbatches, as the preflight does (the search
    predicted the steady microbatches: the same bytes, search.steady_microbatches)."""
    candidate.predictions, candidate.balanced = judged_predictions(candidate.config)
    candidate.fits = stage_fits(candidate.predictions, capacity_gb)


def confirm(ranked: list, top: int, capacity_gb: float, out=None) -> tuple[list, list, float]:
    """(the first ``top`` of ``ranked`` whose dry run fits, those whose dry run did not, seconds):
    each candidate's ``dry`` is set to its stages' dry run. ``out``: one line per dry run."""
    start = time.perf_counter()
    confirmed, dropped = [], []
    for candidate in ranked:
        if len(confirmed) == top:
            break
        began = time.perf_counter()
        exactly(candidate, capacity_gb)
        candidate.dry = dry_run_stages(candidate.config, "cuda")
        candidate.fits = stage_fits(candidate.predictions, capacity_gb, candidate.dry)
        if out is not None:
            measured = len({d.measured_as for d in candidate.dry})
            print(
                f"   dry run of {candidate.layout.describe()}: {measured} stage(s) measured in "
                f"{time.perf_counter() - began:.1f} s",
                file=out,
                flush=True,
            )
        (confirmed if candidate.fit else dropped).append(candidate)
    return confirmed, dropped, time.perf_counter() - start
