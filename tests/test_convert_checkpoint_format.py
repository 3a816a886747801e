"""tools/convert_checkpoint_format.py: a tp 2 x pp 2 ``torch`` checkpoint to ``torch_dist`` (resumed at
tp 1 x pp 2, which only ``torch_dist`` allows) and back to ``torch`` (resumed at tp 2 x pp 2), each
resume training on at the uninterrupted run's losses; bad input is one line before any worker."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from dist_helpers import REPO, SMALL_MODEL, ok, parse_losses, run_pretrain, run_script

TOOL = REPO / "tools" / "convert_checkpoint_format.py"
BASE = [*SMALL_MODEL, "--train-iters", "8"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
TP1_PP2 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]


def convert(cwd, *args: str) -> str:
    """Run the tool; its stdout (it must succeed)."""
    return ok(run_script(TOOL, list(args), cwd)).stdout


def resumed_losses(root, load: str, layout: list[str]) -> dict[int, float]:
    result = ok(run_pretrain([*BASE, *layout, "--load", load], root))
    assert f"successfully loaded checkpoint from {load} at iteration 4" in result.stdout
    return parse_losses(result.stdout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """8 iterations at tp 2 x pp 2, saving in ``torch`` at 4 and 8; their losses."""
    root = tmp_path_factory.mktemp("convert")
    run = ok(run_pretrain([*BASE, *TP2_PP2, "--save", "ckpt", "--save-interval", "4"], root))
    losses = parse_losses(run.stdout)
    assert sorted(losses) == list(range(1, 9))
    return root, losses


def assert_close(got: dict, want: dict) -> None:
    assert sorted(got) == [5, 6, 7, 8]
    for it, loss in got.items():
        assert abs(loss - want[it]) < 5e-4, (it, loss, want[it])


def test_round_trip_resumes_at_the_same_losses(trained):
    root, straight = trained
    out = convert(root, "--load", "ckpt", "--ckpt-step", "4", "--save", "dist", "--ckpt-format", "torch_dist")
    assert "converted checkpoint: ckpt (torch) -> dist (torch_dist), iteration 4" in out
    assert (root / "dist" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert '"sharded_backend": "torch_dist"' in (root / "dist" / "iter_0000004" / "metadata.json").read_text()
    assert_close(resumed_losses(root, "dist", TP1_PP2), straight)  # another layout: torch_dist only

    # Back to torch, upstream's spelling (DIR/<format>): the same files as the original, config aside.
    convert(root, "--load", "dist", "--ckpt-convert-save", "back", "--ckpt-convert-format", "torch")
    back = root / "back" / "torch"
    assert (back / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    shards = sorted(p.name for p in (back / "iter_0000004").iterdir() if p.is_dir())
    assert shards == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    for shard in shards:
        before, after = (
            torch.load(d / "iter_0000004" / shard / "model_optim_rng.pt", weights_only=False)
            for d in (root / "ckpt", back)
        )
        assert before.pop("config")["model"] == after.pop("config")["model"]
        assert_equal_state(before, after, shard)
    assert_close(resumed_losses(root, "back/torch", TP2_PP2), straight)


def assert_equal_state(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            assert_equal_state(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_bad_input_is_one_line_before_any_worker(trained, capsys, monkeypatch):
    root, _ = trained
    spec = importlib.util.spec_from_file_location("convert_checkpoint_format", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.chdir(root)
    (root / "full").mkdir(exist_ok=True)
    (root / "full" / "notes.txt").write_text("mine")
    before = sorted(p.name for p in root.iterdir()), sorted(p.name for p in (root / "ckpt").iterdir())
    for args, named in (
        (["--load", "nowhere", "--save", "o", "--ckpt-format", "torch_dist"], "no such directory"),
        (["--load", "ckpt", "--save", "o", "--ckpt-format", "torch"], "is in torch format already"),
        (["--load", "ckpt", "--save", "ckpt/o", "--ckpt-format", "torch_dist"], "would lie inside --load"),
        (["--load", "ckpt", "--save", "ckpt", "--ckpt-format", "torch_dist"], "would lie inside --load"),
        (["--load", "ckpt", "--save", "o", "--ckpt-format", "torch_dist", "--ckpt-step", "3"], "no iter_0000003"),
        (["--load", "ckpt", "--save", "full", "--ckpt-format", "torch_dist"], "is not an empty directory"),
    ):  # fmt: skip
        assert tool.main(args) == 2
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1, err
    after = sorted(p.name for p in root.iterdir()), sorted(p.name for p in (root / "ckpt").iterdir())
    assert after == before  # nothing written
