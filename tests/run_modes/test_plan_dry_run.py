"""The layout planner's top layouts, confirmed by the dry run (each forks a process per stage): a tiny
flag set's best two, and the Llama-3-70B recipe's best on 32 x 80 GB (bench/plan_llama3_70b.py runs the
best three and prints the figures docs/plan.md quotes)."""

from __future__ import annotations

import io

import pytest

from megatron_lite.run_modes.plan import main, make_plan

TINY = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 16 --train-iters 2 --mock-data --bf16"
).split()


@pytest.mark.world
def test_a_tiny_flag_sets_best_layouts_are_confirmed_by_the_dry_run_within_2_percent(capsys):
    assert main(["--gpus", "4", "--device-memory-gb", "80", "--top", "2", "--", *TINY]) == 0
    out = capsys.readouterr().out
    print(out)
    confirmed = [
        line for line in out.splitlines() if "the dry run confirms it, within 2% on every stage" in line
    ]
    assert len(confirmed) == 2
    assert "dry runs " in out and "search " in out  # the two times, apart


@pytest.mark.world
def test_the_llama3_70b_recipes_best_layout_on_32_gpus_is_confirmed_by_the_dry_run():
    from megatron_lite.recipes import get_recipe

    out = io.StringIO()
    plan = make_plan(get_recipe("llama3_70b_pretrain_config"), 32, 80, top=1, out=out, recipe="llama3_70b")
    print(out.getvalue())
    (best,) = plan.listed
    assert best.fit and best.dry is not None and not plan.dropped
    for p, d in zip(best.predictions, best.dry):
        assert abs(d.max_allocated_bytes - p.peak_bytes) <= 0.02 * p.peak_bytes
        assert d.max_allocated_bytes <= 72e9
