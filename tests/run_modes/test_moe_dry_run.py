"""The dry run of a MoE model: the layers' real code on fake tensors under a routing plan, measured
against a real pp 2 x ep 2 run (exact with padding to capacity; bounded by the worst routing without)."""

from __future__ import annotations

import io

import pytest
from dist_helpers import SMALL_MOE_JOB
from memory_measure import measure

from megatron_lite.run_modes.dry_run import dry_run_stages
from megatron_lite.run_modes.dry_run.moe import routing_plan
from megatron_lite.training.arguments import parse_args
from megatron_lite.training.memory.predict.moe import routed_rows

PADDED = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]


@pytest.mark.world
def test_with_padded_capacity_every_stage_is_the_real_runs_peak_within_3_percent(tmp_path):
    argv = [*SMALL_MOE_JOB, *PADDED]
    out = io.StringIO()
    dry = dry_run_stages(parse_args(argv), out=out)
    measured = [s["peak"][0] * 1e9 for s in measure(argv, 4, tmp_path, quiet=True)]
    print(out.getvalue(), measured, [d.max_allocated_bytes for d in dry])
    assert "balanced routing" in out.getvalue() and "worst" not in out.getvalue()  # one routing: exact
    for stage, (d, m) in enumerate(zip(dry, measured, strict=True)):
        assert d.balanced_max_allocated_bytes is None
        assert abs(d.max_allocated_bytes - m) <= 0.03 * m, (stage, m, d.max_allocated_bytes)


@pytest.mark.world
def test_without_capacity_the_real_runs_peak_stays_under_the_worst_routings_and_that_is_judged(tmp_path):
    out = io.StringIO()
    dry = dry_run_stages(parse_args(SMALL_MOE_JOB), out=out)
    measured = [s["peak"][0] * 1e9 for s in measure(SMALL_MOE_JOB, 4, tmp_path, quiet=True)]
    print(out.getvalue(), measured, dry)
    assert "worst routing / balanced routing" in out.getvalue()
    for stage, (d, m) in enumerate(zip(dry, measured, strict=True)):
        # The figure the preflight judges is the worst routing's; balanced routing's is beside it.
        assert d.balanced_max_allocated_bytes < d.max_allocated_bytes, (stage, d)
        assert m <= d.max_allocated_bytes, (stage, m, d.max_allocated_bytes)


def test_the_plans_route_every_token_k_times_and_the_worst_fills_the_local_experts_to_the_bound():
    m = parse_args(SMALL_MOE_JOB).model  # 4 experts, top 2, ep 2: experts 0 and 1 are ep rank 0's
    tokens = 64
    balanced = routing_plan(m, "balanced")(tokens, 4, [0, 1])
    worst = routing_plan(m, "worst")(tokens, 4, [0, 1])
    assert balanced == [32, 32, 32, 32] and sum(worst) == tokens * 2
    assert 2 * sum(worst[:2]) == routed_rows(m, tokens, "worst")[0]  # 2 ranks' tokens, as predicted
    padded = parse_args([*SMALL_MOE_JOB, "--moe-expert-capacity-factor", "0.5", *PADDED[2:]]).model
    assert routing_plan(padded, "worst")(tokens, 4, [0, 1]) == [16] * 4  # padding fixes the rows
