"""The memory page (megatron_lite/training/memory/picture), read back from its HTML without a browser:
self-contained, one bar group per stage drawn to scale, the measured peak beside the prediction, the
device lines at their heights, one scale for every panel, every text escaped."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from dist_helpers import SMALL_MODEL
from picture_helpers import read_page

from megatron_lite.training.arguments import config_from_argv
from megatron_lite.training.memory.picture import (
    PARTS,
    MemoryPanel,
    StageBars,
    render_memory_page,
    stage_bars_from_predictions,
    write_memory_page,
)
from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

GB = 10**9
STAGE_0 = StageBars(
    0, {"weights": 9 * GB, "grads": 18 * GB, "optimizer": 27 * GB, "activations": 20 * GB, "temporaries": GB}
)
STAGE_1 = StageBars(
    1,
    {"weights": 9 * GB, "grads": 18 * GB, "optimizer": 27 * GB, "activations": 5 * GB, "temporaries": 2 * GB},
)


def _panel(*stages, capacity=80 * GB, title="tp 8 x pp 2", lines=()):
    return MemoryPanel(title, list(stages), capacity, 0.10, lines)


def _px_per_byte(panel) -> float:
    heights = [(h, b) for rects in panel.parts.values() for _, b, _, h in rects]
    return heights[0][0] / heights[0][1]


def _baseline(panel) -> float:
    _, _, y, h = next(iter(panel.parts.values()))[0]
    return y + h


def test_page_is_self_contained():
    html = render_memory_page("70B", [_panel(STAGE_0, STAGE_1)])
    page = read_page(html)
    assert page.references == []  # no src / href at all: nothing to fetch
    assert "script" not in page.tags and "link" not in page.tags and "img" not in page.tags
    assert "url(" not in page.style and "@import" not in page.style
    assert html.startswith("<!DOCTYPE html>") and '<meta charset="utf-8"/>' in html


def test_each_stage_is_one_stack_of_its_parts_in_order_drawn_to_scale():
    (panel,) = read_page(render_memory_page("70B", [_panel(STAGE_0, STAGE_1)])).panels
    assert sorted(panel.parts) == [0, 1]
    ratio, base = _px_per_byte(panel), _baseline(panel)
    for stage in (STAGE_0, STAGE_1):
        rects = panel.parts[stage.stage]
        assert [name for name, *_ in rects] == [p for p in PARTS if p in stage.parts]
        assert {name: b for name, b, _, _ in rects} == stage.parts
        top = base
        for _, nbytes, y, h in rects:  # stacked bottom to top, each height proportional to its bytes
            assert h == pytest.approx(nbytes * ratio, abs=0.01)
            assert y + h == pytest.approx(top, abs=0.02)
            top = y
        assert base - top == pytest.approx(stage.predicted_peak_bytes * ratio, abs=0.05)
    assert "75.0" in panel.texts and "61.0" in panel.texts  # the peaks' GB figures above the bars


def test_every_bar_has_a_title_with_its_figures_for_hover():
    (panel,) = read_page(render_memory_page("70B", [_panel(STAGE_0, STAGE_1)])).panels
    assert panel.titles[0] == (
        "stage 0 predicted peak 75.0 GB: weights 9.00, grads 18.0, optimizer 27.0, activations 20.0, temporaries 1.00"
    )


def test_measured_peak_stands_beside_the_prediction_labelled_as_measured():
    measured = StageBars(0, STAGE_0.parts, measured_peak_bytes=73 * GB, measured_label="dry run")
    html = render_memory_page("70B", [_panel(measured, STAGE_1)])
    (panel,) = read_page(html).panels
    assert list(panel.measured) == [0]  # stage 1 has no measurement: no bar
    nbytes, x, y, h, label = panel.measured[0]
    assert (nbytes, label) == (73 * GB, "dry run")
    assert x > panel.part_x[0]  # to the right of the stack
    assert h == pytest.approx(73 * GB * _px_per_byte(panel), abs=0.01)
    assert y + h == pytest.approx(_baseline(panel), abs=0.02)
    assert "dry run" in panel.texts and "pred." in panel.texts  # each bar says what it is
    assert "dry run (measured on fake tensors)" in html and "predicted peak, by part" in html


def test_capacity_and_usable_lines_stand_at_their_bytes():
    (panel,) = read_page(render_memory_page("70B", [_panel(STAGE_0, STAGE_1)])).panels
    ratio, base = _px_per_byte(panel), _baseline(panel)
    assert panel.lines["capacity"][0] == 80 * GB and panel.lines["usable"][0] == 72 * GB
    for nbytes, y in panel.lines.values():
        assert base - y == pytest.approx(nbytes * ratio, abs=0.02)
    assert "device 80.0 GB" in panel.texts and "usable 72.0 GB" in panel.texts


def test_a_panel_without_capacity_draws_no_device_lines():
    (panel,) = read_page(render_memory_page("cpu run", [_panel(STAGE_0, capacity=None)])).panels
    assert panel.lines == {}


def test_panels_share_one_scale_so_layouts_compare_by_height():
    small = _panel(StageBars(0, {"weights": GB, "activations": GB}), capacity=None, title="small")
    big = _panel(STAGE_0, STAGE_1, capacity=140 * GB, title="big")
    a, b = read_page(render_memory_page("plan", [small, big])).panels
    assert _px_per_byte(a) == pytest.approx(_px_per_byte(b), rel=1e-3)
    assert _baseline(a) == pytest.approx(_baseline(b))
    # The scale clears the largest figure of any panel: here the other panel's 140 GB capacity.
    assert b.lines["capacity"][1] > 0


def test_every_text_is_escaped():
    evil = "<script>alert(1)</script> & co"
    panel = _panel(STAGE_0, title=evil, lines=(evil,))
    html = render_memory_page(evil, [panel], notes=(evil,))
    assert "<script>" not in html
    assert (
        html.count("&lt;script&gt;alert(1)&lt;/script&gt; &amp; co") == 6
    )  # <title>, h1, caption, aria-label, line, note


def test_parts_of_a_prediction_sum_to_its_peak_and_carry_the_dry_run():
    config = config_from_argv([*SMALL_MODEL, "--pipeline-model-parallel-size", "2", "--mock-data"])
    predictions = predict_memory_per_stage(config)
    dry = [SimpleNamespace(max_allocated_bytes=p.peak_bytes + 1000) for p in predictions]
    bars = stage_bars_from_predictions(predictions, dry)
    assert [b.stage for b in bars] == [0, 1]
    for bar, p in zip(bars, predictions):
        assert list(bar.parts) == ["weights", "grads", "optimizer", "activations", "temporaries"]
        assert bar.predicted_peak_bytes == p.peak_bytes
        assert bar.parts["weights"] == p.weights_bytes and bar.parts["temporaries"] == p.temporaries_bytes
        assert (bar.measured_peak_bytes, bar.measured_label) == (p.peak_bytes + 1000, "dry run")
    assert stage_bars_from_predictions(predictions)[0].measured_peak_bytes is None


def test_lora_parts_split_the_adapters_from_the_frozen_weights(tmp_path):
    argv = [
        *SMALL_MODEL,
        "--mock-data",
        "--peft",
        "lora",
        "--lora-dim",
        "4",
        "--pretrained-checkpoint",
        str(tmp_path),
    ]
    (p,) = predict_memory_per_stage(config_from_argv(argv))
    (bar,) = stage_bars_from_predictions([p])
    assert 0 < bar.parts["adapters"] == p.adapter_weights_bytes
    assert bar.parts["weights"] + bar.parts["adapters"] == p.weights_bytes
    assert bar.predicted_peak_bytes == p.peak_bytes


def test_write_memory_page_writes_the_rendered_page(tmp_path):
    path = tmp_path / "memory.html"
    write_memory_page(str(path), "70B", [_panel(STAGE_0)], ("a note",))
    assert path.read_text() == render_memory_page("70B", [_panel(STAGE_0)], ("a note",))
    assert [p.name for p in tmp_path.iterdir()] == ["memory.html"]  # no temporary left behind


def test_a_stage_above_the_usable_line_is_marked_in_red():
    html = render_memory_page("70B", [_panel(STAGE_0, STAGE_1)])  # 75 GB and 61 GB against 72 GB usable
    assert re.search(r'fill="#c00000" font-weight="bold">stage 0<', html)
    assert re.search(r'fill="#000">stage 1<', html)
    assert re.search(r'fill="#c00000"[^>]*>75.0<', html) and re.search(r'fill="#000"[^>]*>61.0<', html)
