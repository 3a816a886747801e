"""--memory-preflight-html: the preflight's verdict drawn on one page (the picture's panel for the job's
stages), and its FILE refused before anything runs when it cannot be written."""

from __future__ import annotations

import io

from megatron_lite.run_modes.preflight import main, preflight

TINY_PP2 = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 2 --mock-data --nproc-per-node 2 "
    "--pipeline-model-parallel-size 2"
).split()


def test_the_preflight_draws_each_stage_and_its_verdict_on_one_page(tmp_path):
    page = tmp_path / "preflight.html"
    out = io.StringIO()
    assert preflight(TINY_PP2, 0.0036, out=out, html_path=str(page)) == 1  # stage 0 needs ~3.85 MB
    assert f"wrote {page}" in out.getvalue()
    html = page.read_text()
    assert "tp 1 x pp 2 x cp 1 x dp 1" in html  # the panel's title: the layout
    assert "verdict: does not fit: stages 0" in html
    assert html.count("stage 0") >= 1 and html.count("stage 1") >= 1
    assert "<svg" in html and "http" not in html.split("<body", 1)[1].replace("http://www.w3.org", "")


def test_an_unwritable_page_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys):
    argv = [*TINY_PP2, "--memory-preflight", "--device-memory-gb", "1"]
    assert main([*argv, "--memory-preflight-html", str(tmp_path / "no" / "such" / "p.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pretrain.py: error: --memory-preflight-html: cannot write"), (
        err
    )
