"""The layout planner's search, from predictions alone (no process started): the Llama-3-70B recipe on
32 x 80 GB GPUs, the preflight's agreement with every rejection, the figures it ranks by, bad input."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from megatron_lite.run_modes.plan import main, make_plan
from megatron_lite.run_modes.plan.figures import figures
from megatron_lite.run_modes.plan.layouts import (
    Layout,
    apply_layout,
    layout_flags,
    layout_of,
    layout_overrides,
    without_layout_flags,
)
from megatron_lite.run_modes.plan.search import predict_candidate, search, steady_microbatches
from megatron_lite.training.cli.parser import build_parser, config_from_args, config_from_argv

# The Llama-3-70B shape (docs/memory.md), at a global batch of 64 so each prediction is quick.
LLAMA3_70B = (
    "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --seq-length 8192 --max-position-embeddings 8192 "
    "--ffn-hidden-size 28672 --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope "
    "--rotary-base 500000 --group-query-attention --num-query-groups 8 --untie-embeddings-and-output-weights "
    "--disable-bias-linear --vocab-size 128256 --make-vocab-size-divisible-by 128 --micro-batch-size 1 "
    "--global-batch-size 64 --bf16 --train-iters 1000 --mock-data --tensor-model-parallel-size 4 "
    "--pipeline-model-parallel-size 4 --virtual-pipeline-model-parallel-size 5 --context-parallel-size 2 "
    "--sequence-parallel --use-distributed-optimizer"
).split()
TINY = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 16 --train-iters 2 --mock-data --bf16"
).split()
USABLE_80 = 72e9


def _base(argv):
    return config_from_args(build_parser().parse_args(argv))


@pytest.fixture(scope="module")
def recipe_plan():
    from megatron_lite.recipes import get_recipe

    out = io.StringIO()
    plan = make_plan(
        get_recipe("llama3_70b_pretrain_config"),
        32,
        80,
        dry_run=False,
        out=out,
        recipe="x",
        given_label="the recipe's own layout",
    )
    print(out.getvalue())
    return plan, out.getvalue()


def test_the_llama3_70b_recipe_on_32_gpus_of_80_gb_lists_three_distinct_splits_that_fit(recipe_plan):
    plan, text = recipe_plan
    assert len(plan.listed) >= 3
    splits = {(c.layout.tp, c.layout.pp, c.layout.cp) for c in plan.listed}
    assert len(splits) == len(plan.listed)
    for c in plan.listed:
        assert c.layout.dp * c.layout.tp * c.layout.pp * c.layout.cp == 32
        assert all(0 < p.peak_bytes <= USABLE_80 for p in c.predictions)
    keys = [c.figures.rank_key() for c in plan.listed]
    assert keys == sorted(keys)
    assert "ranking (NOT a measured time)" in text


def test_bridges_own_layout_is_placed_or_the_plan_says_which_stage_runs_out_and_why(recipe_plan):
    plan, text = recipe_plan
    given = plan.given
    assert given.layout.grid == (4, 4, 5, 2, 1) and given.layout.dp == 1  # tp 4 pp 4 vp 5 cp 2: dp 1
    if given.fit:
        assert "fits; it ranks " in text
    else:
        peak = max(given.peaks)
        assert peak > USABLE_80
        line = next(x for x in text.splitlines() if "the recipe's own layout" in x)
        assert "does not fit; stage 0 runs out" in line and f"{peak / 1e9:.4g} GB > 72 GB usable" in line
        assert "sharded over dp x cp = 2" in line  # why the static memory is large


@pytest.mark.filterwarnings("ignore::UserWarning")  # the flags' own notes (the optimizer settings synced)
def test_every_layout_it_rejects_for_memory_the_preflight_rejects_too():
    """The real preflight, on the flags the plan prints, for the three rejections nearest to fitting and
    the farthest one, and for the two best layouts that fit."""
    from megatron_lite.run_modes.preflight import preflight

    result = search(_base(LLAMA3_70B), 32, 80)
    assert result.rejected and result.fitting
    by_peak = sorted(result.rejected, key=lambda c: max(c.peaks))
    sample = [*by_peak[:3], by_peak[-1]]
    rest = without_layout_flags(LLAMA3_70B)
    for candidate, code in [*((c, 1) for c in sample), *((c, 0) for c in result.fitting[:2])]:
        argv = [*rest, *layout_flags(candidate.layout, 32)]
        assert layout_of(config_from_argv(argv)) == candidate.layout  # the printed flags are the layout
        assert preflight(argv, 80, out=io.StringIO()) == code, candidate.layout


def test_a_prediction_over_the_steady_microbatches_is_the_whole_steps_byte_for_byte():
    base = _base([*without_layout_flags(LLAMA3_70B), "--global-batch-size", "296"])
    for layout in (
        Layout(8, 4, 5, 1, 1, sp=True),
        Layout(4, 2, 1, 1, 4, sp=True),
        Layout(2, 8, 2, 1, 1, sp=True),
    ):
        config = apply_layout(base, layout, layout.tp * layout.pp * layout.cp * layout.dp)
        assert steady_microbatches(config) < config.num_microbatches
        short = predict_candidate(config, layout, 80).predictions
        whole = predict_candidate(config, layout, 80, exact=True).predictions
        assert [dataclasses.asdict(p) for p in short] == [dataclasses.asdict(p) for p in whole]


def test_the_figures_follow_the_bubble_formula_and_what_the_code_moves():
    base = _base(without_layout_flags(LLAMA3_70B))
    interleaved = Layout(4, 4, 5, 2, 1, sp=True)
    config = apply_layout(base, interleaved, 32)
    f = figures(config, interleaved, predict_candidate(config, interleaved, 80).predictions)
    assert f.bubble == pytest.approx(3 / (5 * 64))  # (pp - 1) / (vp m)
    assert f.comm_bytes["CP"] > 0 and f.comm_bytes["PP"] > 0 and f.comm_bytes["DP"] > 0
    no_sp = dataclasses.replace(interleaved, sp=False)
    g = figures(apply_layout(base, no_sp, 32), no_sp, predict_candidate(config, interleaved, 80).predictions)
    assert f.comm_bytes["TP"] / g.comm_bytes["TP"] == pytest.approx(
        10 / 8, rel=0.01
    )  # SP re-gathers in backward
    ddp = dataclasses.replace(interleaved, distopt=False)
    h = figures(apply_layout(base, ddp, 32), ddp, predict_candidate(config, interleaved, 80).predictions)
    assert h.comm_bytes["DP"] > f.comm_bytes["DP"]


def test_nothing_fits_exits_1_and_names_the_nearest_miss(capsys):
    assert main(["--gpus", "2", "--device-memory-gb", "0.001", "--no-dry-run", "--", *TINY]) == 1
    out = capsys.readouterr().out
    assert "nothing fits; the nearest miss is tp " in out and "runs out" in out


def test_the_plan_is_written_as_json_and_as_a_picture(tmp_path, capsys):
    json_path, html_path = tmp_path / "plan.json", tmp_path / "plan.html"
    argv = ["--gpus", "4", "--device-memory-gb", "80", "--no-dry-run", "--top", "2"]
    assert main([*argv, "--json", str(json_path), "--html", str(html_path), "--", *TINY]) == 0
    record = json.loads(json_path.read_text())
    assert record["fits"] and len(record["listed"]) == 2 and record["counts"]["fit"] >= 2
    first = record["listed"][0]
    assert first["rank"] == 1 and "--tensor-model-parallel-size" in first["flags"]
    assert all(s["predicted_max_allocated_bytes"] > 0 for s in first["stages"])
    page = html_path.read_text()
    assert "#1 tp " in page and "#2 tp " in page and "NOT a measured time" in page


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--recipe", "llama3_70b_pretrain_confg", "--gpus", "32", "--device-memory-gb", "80"],
            "llama3_70b_pretrain_config",
        ),
        (
            ["--recipe", "llama3_70b_pretrain_config", "--gpus", "0", "--device-memory-gb", "80"],
            "--gpus: must be a positive",
        ),
        (
            ["--recipe", "llama3_70b_pretrain_config", "--gpus", "x", "--device-memory-gb", "80"],
            "--gpus: must be a positive",
        ),
        (
            ["--recipe", "llama3_70b_pretrain_config", "--gpus", "8", "--device-memory-gb", "-1"],
            "--device-memory-gb: must be",
        ),
        (["--gpus", "8", "--device-memory-gb", "80"], "--recipe: needs a recipe NAME"),
        (["--gpus", "4", "--device-memory-gb", "80", "--", *TINY, "--no-such-flag"], "pretrain.py's flags"),
        (
            ["--gpus", "4", "--device-memory-gb", "80", "--", *TINY, "--seq-length", "128"],
            "no layout of this job validates",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m megatron_lite.plan: error: "), lines
    assert message in lines[0], lines
    assert captured.out == ""


def test_recipe_overrides_clear_a_recompute_method_the_layout_does_not_use():
    """apply_layout clears the method and count; the printed overrides must too, or a job that had
    full recompute gets a method without it, which the validation refuses."""
    plain = Layout(tp=2, pp=1, vp=1, cp=1, dp=1, sp=True)
    overrides = layout_overrides(plain)
    assert "model.recompute_method=null" in overrides and "model.recompute_num_layers=null" in overrides
