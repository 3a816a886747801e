"""Recomputation and sequence parallelism: each lever computes exactly what the run without it computes,
and the per-stage dashboards show its saving (measured: bytes saved for backward, per stage)."""

from __future__ import annotations

import glob

import pytest
import torch
from dist_helpers import SMALL_MODEL, loss_lines, run_pretrain
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.world  # every test here starts processes

ITERS = 4
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
LEVERS = {
    "none": [],
    "full-uniform": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split(),
    "full-block": "--recompute-granularity full --recompute-method block --recompute-num-layers 1".split(),
    "selective": ["--recompute-activations"],
}


def _final_weights(tmp_path, lever: str, extra: list[str], layout=("--pipeline-model-parallel-size", "2")):
    """(iteration -> printed loss, the weights after the last step) of a run (pp = 2 by default)."""
    run_dir = tmp_path / lever
    run_dir.mkdir()
    args = [
        *SMALL_MODEL,
        *f"--train-iters {ITERS} --save ckpt --save-interval {ITERS}".split(),
        *layout,
        *LEVERS[lever],
        *extra,
    ]
    result = run_pretrain(args, run_dir)
    assert result.returncode == 0, result.stderr
    weights = {}
    for shard in sorted(glob.glob(str(run_dir / "ckpt" / f"iter_{ITERS:07d}" / "*" / "model_optim_rng.pt"))):
        weights[shard.split("/")[-2]] = torch.load(shard, weights_only=False)["model"]
    assert weights
    return loss_lines(result.stdout), weights


def _assert_same(weights: dict, other: dict, lever: str) -> None:
    for shard, state in weights.items():
        for name, tensor in state.items():
            assert torch.equal(other[shard][name], tensor), (lever, shard, name)


def test_recomputation_changes_nothing_bitwise(tmp_path):
    """The weights after 4 steps (so every loss and gradient before them) are bitwise those of the
    run without recomputation; with dropout (on, so that the recompute must replay every RNG stream)."""
    extra = DROPOUT
    losses, weights = _final_weights(tmp_path, "none", extra)
    for lever in ("full-uniform", "full-block", "selective"):
        lever_losses, lever_weights = _final_weights(tmp_path, lever, extra)
        assert lever_losses == losses, lever
        _assert_same(weights, lever_weights, lever)


def test_distributed_saved_activations_change_nothing_bitwise(tmp_path):
    """At tp = 2 each recomputed chunk's input is kept as a 1/2 share and gathered back for backward;
    at pp = 2, so the second stage's first share is of a received input, whose gradient is accumulated."""
    tp2 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    losses, weights = _final_weights(tmp_path, "none", DROPOUT, tp2)
    extra = [*DROPOUT, "--distribute-saved-activations"]
    distributed_losses, distributed = _final_weights(tmp_path, "full-uniform", extra, tp2)
    assert distributed_losses == losses
    _assert_same(weights, distributed, "distribute-saved-activations")


def _stage_peaks(tmp_path, name: str, args: list[str], stages: int) -> list[float]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    result = run_pretrain([*args, "--tensorboard-dir", "tb", "--log-memory-to-tensorboard"], run_dir)
    assert result.returncode == 0, result.stderr
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tag = (
        "memory/pp-stage-{}/mem-max-activation-gigabytes"
        if stages > 1
        else "memory/mem-max-activation-gigabytes"
    )
    return [max(e.value for e in acc.Scalars(tag.format(stage))) for stage in range(stages)]


PP4 = (
    "--pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --vocab-size 128 --micro-batch-size 2 --global-batch-size 16 --train-iters 2 "
    "--log-memory-per-pp-stage"
).split()


def test_recomputation_lowers_stage_0_peak_as_megatron_predicts(tmp_path):
    """pp = 4, 8 layers (2 per stage), stage 0 holds 4 microbatches in flight. Uniform with N = 1
    keeps one [s, b, h] input per layer plus one layer's activations while it is recomputed; block with
    N = 1 recomputes one of the stage's two layers."""
    none = _stage_peaks(tmp_path, "none", PP4, 4)
    uniform = _stage_peaks(tmp_path, "uniform", [*PP4, *LEVERS["full-uniform"]], 4)
    block = _stage_peaks(tmp_path, "block", [*PP4, *LEVERS["full-block"]], 4)
    assert none[0] == max(none)  # 1F1B: the first stage holds the most
    assert uniform[0] <= 0.35 * none[0], (uniform, none)
    assert 0.4 * none[0] <= block[0] <= 0.75 * none[0], (block, none)
    for stage in range(4):
        assert uniform[stage] < block[stage] < none[stage]


def test_sequence_parallel_lowers_the_per_rank_peak(tmp_path):
    tp2 = [*SMALL_MODEL, "--train-iters", "2", "--tensor-model-parallel-size", "2"]
    without = _stage_peaks(tmp_path, "tp2", tp2, 1)[0]
    with_sp = _stage_peaks(tmp_path, "tp2-sp", [*tp2, "--sequence-parallel"], 1)[0]
    assert with_sp < 0.85 * without, (with_sp, without)
