"""tools/convert_checkpoint_format.py: a tp 2 x pp 2 ``torch`` checkpoint to ``torch_dist`` (resumed at
tp 1 x pp 2, which only ``torch_dist`` allows) and back to ``torch`` (resumed at tp 2 x pp 2), each
resume training on at the uninterrupted run's losses; bad input is one line before any worker. A
mixture-of-experts checkpoint (ep 2, files ``mp_rank_00_EEE``) converts too: to ``torch_dist``, resumed
at ep 1, and back to the original's files."""

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


def resumed_losses(root, load: str, layout: list[str], base: list[str] = BASE) -> dict[int, float]:
    result = ok(run_pretrain([*base, *layout, "--load", load], root))
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


@pytest.mark.world
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
    assert_same_files(root / "ckpt", back, shards)
    assert_close(resumed_losses(root, "back/torch", TP2_PP2), straight)


def assert_same_files(before_root, after_root, shards: list[str]) -> None:
    """Each shard's files (``model_optim_rng.pt``, any ``distrib_optim.pt``) in ``after_root`` hold
    what ``before_root``'s do, config aside."""
    for shard in shards:
        before_dir, after_dir = (d / "iter_0000004" / shard for d in (before_root, after_root))
        names = sorted(p.name for p in before_dir.iterdir())
        assert sorted(p.name for p in after_dir.iterdir()) == names, shard
        for name in names:
            before, after = (torch.load(d / name, weights_only=False) for d in (before_dir, after_dir))
            if name == "model_optim_rng.pt":
                assert before.pop("config")["model"] == after.pop("config")["model"]
            assert_equal_state(before, after, f"{shard}/{name}")


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


@pytest.mark.world
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


MOE = [
    *BASE,
    *("--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-grouped-gemm"),
    *("--moe-token-dispatcher-type", "alltoall", "--swiglu", "--disable-bias-linear"),
    *("--use-distributed-optimizer", "--nproc-per-node", "2"),
]


@pytest.mark.world
def test_moe_round_trip_resumes_at_another_expert_parallel_size(tmp_path):
    run = ok(
        run_pretrain(
            [*MOE, "--expert-model-parallel-size", "2", "--save", "ckpt", "--save-interval", "4"], tmp_path
        )
    )
    straight = parse_losses(run.stdout)
    out = convert(
        tmp_path, "--load", "ckpt", "--ckpt-step", "4", "--save", "dist", "--ckpt-format", "torch_dist"
    )
    assert "converted checkpoint: ckpt (torch) -> dist (torch_dist), iteration 4" in out
    assert_close(resumed_losses(tmp_path, "dist", ["--ckpt-format", "torch_dist"], MOE), straight)  # at ep 1

    convert(tmp_path, "--load", "dist", "--save", "back", "--ckpt-format", "torch")
    shards = sorted(p.name for p in (tmp_path / "back" / "iter_0000004").iterdir() if p.is_dir())
    assert shards == ["mp_rank_00_000", "mp_rank_00_001"]
    assert_same_files(tmp_path / "ckpt", tmp_path / "back", shards)  # resumes as the original does
