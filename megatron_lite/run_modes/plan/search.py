"""The search: every layout of layouts.py, validated, predicted with the preflight's own judgement
(preflight_json.judged_predictions / stage_fits), kept when every stage fits with the reserve, and
ranked by figures.py's key.

Per parallel grid (tp, pp, vp, cp, ep) the levers only trade memory for extra FLOPs (and, for full
recompute, the recomputed layers' TP collectives): the search first predicts the grid with the most
memory-saving levers (every layer recomputed, the fused loss); when that does not fit, nothing of the
grid does (the other lever sets keep more) and the grid is rejected. Otherwise it predicts the lever
sets cheapest first and keeps the first that fits: every costlier one fits too and is dominated (the
same bubble, more FLOPs, at least as many bytes), so it is counted as pruned, not predicted.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

from megatron_lite.run_modes.dry_run.microbatches import with_microbatches
from megatron_lite.run_modes.plan.figures import Figures, figures, recompute_fraction
from megatron_lite.run_modes.plan.layouts import (
    Layout,
    apply_layout,
    layers_per_chunk,
    lever_sets,
    parallel_grids,
)
from megatron_lite.run_modes.preflight_json import judged_predictions, stage_fits, stage_peaks, usable_gb
from megatron_lite.training.errors import ConfigError


@dataclass
class Candidate:
    """One predicted layout: its config, its judged predictions (balanced routing's beside for open
    MoE routing), whether each stage fits, and its ranking figures."""

    layout: Layout
    config: object
    predictions: list
    balanced: list | None
    fits: list[bool]
    figures: Figures | None = None
    dry: list | None = None
    """The dry run's stages, once confirmed."""

    @property
    def peaks(self) -> list[int]:
        return stage_peaks(self.predictions, self.dry)

    @property
    def fit(self) -> bool:
        return all(self.fits)


@dataclass
class SearchResult:
    """What the search found, and what it set aside and why."""

    fitting: list[Candidate]
    """The layouts that fit, best first (one per parallel grid: its cheapest lever set that fits)."""
    rejected: list[Candidate]
    """Predicted and did not fit: every stage's peak judged as the preflight judges it."""
    refused: dict[str, int] = field(default_factory=dict)
    """Layouts the validation refused, counted by its message's first words."""
    pruned: int = 0
    """Lever sets not predicted: dominated by a cheaper one of the same grid that fits, or needing
    more memory than the grid's leanest, which does not fit."""
    grids: int = 0
    predicted: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """This process's CPU time over the search (the wall time grows on a shared machine)."""


def _build(base, layout: Layout, gpus: int, refused: dict[str, int]):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return apply_layout(base, layout, gpus)
    except (ConfigError, ValueError, AssertionError) as err:
        reason = str(err).split(":", 1)[0][:60]
        refused[reason] = refused.get(reason, 0) + 1
        return None


def steady_microbatches(config) -> int:
    """Microbatches whose schedule reaches every state the job's does: the warmup, two full periods of
    the steady state (``group`` microbatches through every chunk) and the cooldown, with the job's
    remainder modulo ``group`` (so its last, partial group too). Each further period repeats the same
    saves and frees, so every stage's predicted peak is the job's (tests/run_modes/test_plan_search.py
    checks it, byte for byte); all of them under --defer-embedding-wgrad-compute, whose buffers grow
    with every microbatch."""
    m, total = config.model, config.num_microbatches
    if m.defer_embedding_wgrad_compute:
        return total
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    group = m.microbatch_group_size_per_vp_stage or pp
    warmup = 2 * (pp - 1) + (vp - 1) * group if vp > 1 else pp - 1
    enough = -(-warmup // vp) + 2 * group + 1
    if total <= enough + group:
        return total
    return enough + (total - enough) % group


def predict_candidate(config, layout: Layout, capacity_gb: float, exact: bool = False) -> Candidate:
    """``layout``'s (``config`` its validated ConfigContainer) judged predictions and verdict: over
    :func:`steady_microbatches` of the step's microbatches (the same peaks), or all with ``exact``."""
    short = config if exact else with_microbatches(config, steady_microbatches(config))
    predictions, balanced = judged_predictions(short)
    candidate = Candidate(layout, config, predictions, balanced, stage_fits(predictions, capacity_gb))
    candidate.figures = figures(config, layout, predictions)
    return candidate


def search(base, gpus: int, capacity_gb: float) -> SearchResult:
    """Search every layout of ``base`` (a ConfigContainer, not validated) on ``gpus`` GPUs of
    ``capacity_gb`` GB (module docstring)."""
    start, cpu = time.perf_counter(), time.process_time()
    result = SearchResult([], [])
    for grid in parallel_grids(base, gpus):
        result.grids += 1
        tp, pp, vp, cp, ep = grid
        plain = Layout(tp, pp, vp, cp, gpus // (tp * pp * cp), ep, sp=tp > 1)
        probe = _build(base, plain, gpus, result.refused)
        if probe is None:
            continue
        levers = lever_sets(grid, gpus, layers_per_chunk(probe))
        levers.sort(key=lambda lay: (recompute_fraction(probe, lay), lay.recompute is not None))
        leanest = max(levers, key=lambda lay: (lay.recompute == "full", lay.recompute_layers, lay.fused_loss))
        config = _build(base, leanest, gpus, result.refused)
        if config is None:
            result.pruned += len(levers) - 1
            continue
        lean = predict_candidate(config, leanest, capacity_gb)
        result.predicted += 1
        if not lean.fit:
            result.rejected.append(lean)
            result.pruned += len(levers) - 1
            continue
        tried = {leanest}
        for layout in levers:
            if layout == leanest:
                candidate = lean
            else:
                tried.add(layout)
                config = probe if layout == plain else _build(base, layout, gpus, result.refused)
                if config is None:
                    continue
                candidate = predict_candidate(config, layout, capacity_gb)
                result.predicted += 1
            if candidate.fit:
                result.fitting.append(candidate)
                break
            result.rejected.append(candidate)
        result.pruned += len(levers) - len(tried)
    result.fitting.sort(key=lambda c: c.figures.rank_key())
    result.seconds, result.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return result


def nearest_miss(rejected: list[Candidate], capacity_gb: float) -> Candidate | None:
    """The rejected layout whose worst stage comes closest to the usable memory."""
    if not rejected:
        return None
    return min(rejected, key=lambda c: max(c.peaks) / 1e9 / usable_gb(capacity_gb))
