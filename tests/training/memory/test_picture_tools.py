"""The picture's tools without a browser: tools/memory_report.py --html from a run's event files (the
names a real run logs, written here with TensorBoard's writer), and tools/render_html.py's refusals."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from dist_helpers import REPO, SMALL_MODEL
from picture_helpers import read_page

from megatron_lite.training.arguments import config_from_argv
from megatron_lite.training.memory.predict.stages import predict_memory_per_stage, predicted_memory_metrics


def _tool(name: str):
    """tools/<name>.py as a module, loaded now: its ``out=sys.stdout`` defaults bind the test's capture."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


render_html = _tool("render_html")


def _log_run(logdir, predictions, measured_gb: list[list[float]], capacity_gb=None) -> None:
    """Event files as a --log-memory-per-pp-stage run writes them: the predictions at step 0, each
    stage's measured allocated peak per step, the capacity where the device reports one."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(logdir)) as writer:
        for tag, value in predicted_memory_metrics(predictions).items():
            writer.add_scalar(tag, value, 0)
        for step, peaks in enumerate(measured_gb, start=1):
            for stage, peak in enumerate(peaks):
                writer.add_scalar(f"memory/pp-stage-{stage}/mem-max-allocated-gigabytes", peak, step)
            writer.add_scalar("memory/mem-max-allocated-gigabytes", max(peaks), step)
            if capacity_gb is not None:
                writer.add_scalar("memory/capacity-gigabytes", capacity_gb, step)


def _predictions(*extra):
    return predict_memory_per_stage(config_from_argv([*SMALL_MODEL, "--mock-data", *extra]))


def test_memory_report_html_stacks_the_logged_prediction_beside_the_measured_peak(tmp_path, capsys):
    predictions = _predictions("--pipeline-model-parallel-size", "2")
    _log_run(tmp_path / "tb", predictions, [[0.002, 0.0015], [0.0031, 0.0024]], capacity_gb=0.004)
    page = tmp_path / "memory.html"
    assert _tool("memory_report").main([str(tmp_path / "tb"), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "measured vs predicted" in out and f"page written to {page}" in out  # the text report stays
    (panel,) = read_page(page.read_text()).panels
    for p in predictions:
        parts = {name: nbytes for name, nbytes, _, _ in panel.parts[p.pp_rank]}
        assert list(parts) == ["weights", "grads", "optimizer", "activations", "temporaries"]
        # The logged figures have 5 significant digits: the parts sum to the logged peak exactly.
        assert sum(parts.values()) == round(float(f"{p.peak_bytes / 1e9:.5g}") * 1e9)
        assert parts["weights"] == pytest.approx(p.weights_bytes, rel=1e-4)
    assert [panel.measured[s][0] for s in (0, 1)] == [3_100_000, 2_400_000]  # the peak over the run
    assert panel.measured[0][4] == "measured"
    assert panel.lines["capacity"][0] == 4_000_000 and panel.lines["usable"][0] == 3_600_000


def test_memory_report_html_of_a_lora_run_splits_off_the_adapters(tmp_path, capsys):
    predictions = _predictions("--peft", "lora", "--lora-dim", "4", "--pretrained-checkpoint", str(tmp_path))
    _log_run(tmp_path / "tb", predictions, [[0.003]])
    assert _tool("memory_report").main([str(tmp_path / "tb"), "--html", str(tmp_path / "m.html")]) == 0
    (panel,) = read_page((tmp_path / "m.html").read_text()).panels
    parts = {name: nbytes for name, nbytes, _, _ in panel.parts[0]}
    assert parts["adapters"] == pytest.approx(predictions[0].adapter_weights_bytes, rel=1e-4)
    assert parts["weights"] + parts["adapters"] == pytest.approx(predictions[0].weights_bytes, rel=1e-4)
    assert panel.lines == {}  # a CPU run logs no capacity


def test_memory_report_html_refuses_a_run_without_per_stage_metrics(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "tb")) as writer:
        writer.add_scalar("memory/mem-max-allocated-gigabytes", 1.0, 1)
    assert _tool("memory_report").main([str(tmp_path / "tb"), "--html", str(tmp_path / "m.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--log-memory-per-pp-stage" in err
    assert not (tmp_path / "m.html").exists()


def test_render_html_without_chromium_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "page.html").write_text("<!DOCTYPE html><p>x</p>")
    monkeypatch.setattr(render_html, "CHROMIUM", str(tmp_path / "no-chromium"))
    assert render_html.main([str(tmp_path / "page.html"), str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run `make browser` (installs Debian's chromium)" in err
    assert not (tmp_path / "out.png").exists()


def test_render_html_refuses_a_missing_page(tmp_path, capsys):
    assert render_html.main([str(tmp_path / "none.html"), str(tmp_path / "out.png")]) == 2
    assert "none.html is not a file" in capsys.readouterr().err


def test_render_html_runs_chromium_headless_offline_with_a_fresh_profile(tmp_path):
    command = render_html.chromium_command("page.html", "out.png", 1280, 900, str(tmp_path))
    assert command[0] == render_html.CHROMIUM
    for flag in (
        "--headless",
        "--disable-background-networking",
        "--disable-sync",
        "--proxy-server=127.0.0.1:9",
    ):
        assert flag in command
    assert ("--no-sandbox" in command) == (os.geteuid() == 0)  # the sandbox stays on where it can start
    assert f"--user-data-dir={tmp_path}" in command and "--window-size=1280,900" in command
    assert command[-1].startswith("file:///") and command[-1].endswith("/page.html")


def test_a_run_that_logged_no_prediction_shows_its_measurement_alone():
    from megatron_lite.training.memory.picture import MemoryPanel, render_memory_page
    from megatron_lite.training.memory.picture.logged import stage_bars_from_logged

    bars = stage_bars_from_logged({"mem-max-allocated-gigabytes": {0: 2.5, 1: 1.5}})
    assert [(b.stage, b.parts, b.measured_peak_bytes) for b in bars] == [
        (0, {}, 2_500_000_000),
        (1, {}, 1_500_000_000),
    ]
    (panel,) = read_page(render_memory_page("run", [MemoryPanel("run", bars)])).panels
    assert panel.parts == {} and sorted(panel.measured) == [0, 1]


def test_render_html_measures_a_script_bearing_copy_and_leaves_the_page_script_free(tmp_path, monkeypatch):
    page = tmp_path / "page.html"
    page.write_text("<!DOCTYPE html><html><body><p>x</p></body></html>")
    work = tmp_path / "work"
    work.mkdir()
    seen = []

    def fake_chromium(command, timeout):  # the boundary: chromium's --dump-dom of the copy
        seen.append(command)
        return 0, '<html><body data-render-height="1234"><p>x</p></body></html>'

    monkeypatch.setattr(render_html, "_run", fake_chromium)
    assert render_html.measure_height(str(page), 1280, 5.0, str(work)) == 1234
    (command,) = seen
    assert "--dump-dom" in command and "--window-size=1280,600" in command
    copy = (work / "measure.html").read_text()
    assert command[-1] == (work / "measure.html").as_uri()
    assert copy.endswith(render_html.MEASURE + "</body></html>")
    assert "<script" not in page.read_text()
