"""--memory-preflight: the per-stage prediction for an exact command line, a verdict, and the cheapest
fix, without building a world; on the README's cluster example at its real size."""

from __future__ import annotations

import io
import json
import os
import re
import time

import pytest
from dist_helpers import run_pretrain
from preflight_helpers import FIRST_STAGE_HEAVY, predicted_table, readme_cluster_argv


# Recomputation already full, one rank per stage, 16384 learned position rows on the first stage.
def _preflight(tmp_path, argv, device_gb):
    start = time.perf_counter()
    result = run_pretrain(
        [*argv, "--memory-preflight", "--device-memory-gb", str(device_gb)], tmp_path, timeout=120
    )
    print(result.stdout, f"(wall {time.perf_counter() - start:.1f} s)")
    assert os.listdir(tmp_path) == []  # no world, no logs, no checkpoints
    assert result.stderr == ""
    return result


@pytest.mark.world
def test_the_readme_cluster_example_fits_an_80_gb_gpu(tmp_path):
    argv = readme_cluster_argv()
    result = _preflight(tmp_path, argv, 80)
    assert result.returncode == 0, result.stdout
    totals = predicted_table(result.stdout)
    assert sorted(totals) == [0, 1, 2, 3]  # one row per pipeline stage
    assert all(0 < t <= 72 for t in totals.values())
    assert "verdict: fits" in result.stdout


@pytest.mark.world
def test_a_layout_that_does_not_fit_names_the_stage_and_the_fix_that_makes_it_fit(tmp_path):
    argv = readme_cluster_argv()
    totals = predicted_table(_preflight(tmp_path, argv, 80).stdout)
    device = round(max(totals.values()) * 0.8, 1)  # smaller than the peak stage needs
    result = _preflight(tmp_path, argv, device)
    assert result.returncode == 1
    # The table rounds to 3 digits: the stage named is one of those that print the largest peak.
    named = int(re.search(r"stage (\d+) runs out first", result.stdout).group(1))
    assert totals[named] == max(totals.values()), result.stdout
    fix = re.search(r"cheapest change that fits every stage: (.*?)  \(", result.stdout).group(1).split()
    applied = _preflight(tmp_path, [*argv, *fix], device)
    assert applied.returncode == 0, applied.stdout
    assert "verdict: fits" in applied.stdout


@pytest.mark.world
def test_preflight_bad_input_is_one_line_and_exit_2(tmp_path):
    argv = readme_cluster_argv()
    for extra, message in (
        (["--memory-preflight"], "--memory-preflight: needs --device-memory-gb"),
        (
            ["--memory-preflight", "--device-memory-gb", "-3"],
            "--device-memory-gb: must be a finite number > 0 (GB)",
        ),
        (["--device-memory-gb", "80"], "--memory-preflight: is a mode of pretrain.py"),
    ):
        result = run_pretrain([*argv, *extra], tmp_path)
        assert result.returncode == 2, (extra, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pretrain.py: error: ") and message in lines[0], lines
    assert os.listdir(tmp_path) == []


def test_a_first_stage_heavy_layout_is_fixed_by_moving_layers_to_the_last_stage():
    """Recomputation already full and one rank per stage: of the levers left, moving a layer off the
    first stage (its 16384 learned position rows, and the most microbatches in flight) is cheaper than
    twice the GPUs."""
    from megatron_lite.run_modes.preflight import preflight

    argv = FIRST_STAGE_HEAVY
    out = io.StringIO()
    assert preflight(argv, 100, out) == 0
    totals = predicted_table(out.getvalue())
    device = round(max(totals.values()) * 0.95 / 0.9, 3)  # the peak stage misses by 5%
    out = io.StringIO()
    assert preflight(argv, device, out) == 1
    assert "stage 0 runs out first" in out.getvalue()
    fix = re.search(r"cheapest change that fits every stage: (.*?)  \(", out.getvalue()).group(1).split()
    assert fix == "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3".split()
    out = io.StringIO()
    assert preflight([*argv, *fix], device, out) == 0, out.getvalue()


@pytest.mark.world
def test_the_json_holds_the_table_the_verdict_and_the_fix(tmp_path):
    """--memory-preflight-json FILE: per stage the bytes the table shows in GB, the verdict and the
    flags of the fix; a FILE that cannot be written is one line before anything runs."""
    argv = [*readme_cluster_argv(), "--memory-preflight", "--memory-preflight-json", "preflight.json"]
    fits = run_pretrain([*argv, "--device-memory-gb", "80"], tmp_path, timeout=120)
    record = json.loads((tmp_path / "preflight.json").read_text())
    table = predicted_table(fits.stdout)
    assert [s["stage"] for s in record["stages"]] == sorted(table)
    for s in record["stages"]:
        parts = ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes")
        assert sum(s[k] for k in parts) == s["predicted_max_allocated_bytes"]
        assert f"{s['predicted_max_allocated_bytes'] / 1e9:.3g}" == f"{table[s['stage']]:.3g}"
    assert (record["fits"], record["recommendation"], record["device_bytes"]) == (True, "", 80 * 10**9)

    device = f"{max(table.values()) * 0.8:.1f}"
    short = run_pretrain([*argv, "--device-memory-gb", device], tmp_path, timeout=120)
    record = json.loads((tmp_path / "preflight.json").read_text())
    fix = re.search(r"cheapest change that fits every stage: (.*?)  \(", short.stdout).group(1)
    assert short.returncode == 1 and (record["fits"], record["recommendation"]) == (False, fix)
    assert sorted(os.listdir(tmp_path)) == ["preflight.json"]  # written atomically: no temporary left

    bad = run_pretrain([*argv[:-1], "missing/preflight.json", "--device-memory-gb", "80"], tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--memory-preflight-json" in bad.stderr
    assert sorted(os.listdir(tmp_path)) == ["preflight.json"]


def test_block_recompute_already_on_is_offered_more_layers_not_selective():
    """FIRST_STAGE_HEAVY with block recompute of 1 of each stage's 2 layers: the second is left."""
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.memory.levers import candidate_changes

    argv = " ".join(FIRST_STAGE_HEAVY).replace("--recompute-method uniform", "--recompute-method block")
    changes = candidate_changes(parse_args(argv.split()))
    flag = "--recompute-num-layers"
    layers = {c.flags[c.flags.index(flag) + 1] for c in changes if flag in c.flags}
    assert layers == {"2"}
    assert not any("selective" in c.flags for c in changes)
