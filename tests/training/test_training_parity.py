"""Every parallel layout computes what one process computes: per-iteration lm loss parity."""

from __future__ import annotations

import pytest
from dist_helpers import SMALL_MODEL, parse_losses, run_pretrain

ITERS = 8


def _losses(tmp_path, tp: int, pp: int, dp: int, extra=(), cp: int = 1) -> dict[int, float]:
    args = [
        *SMALL_MODEL,
        *f"--train-iters {ITERS} --seed 1234 --tensor-model-parallel-size {tp} "
        f"--pipeline-model-parallel-size {pp} --context-parallel-size {cp} "
        f"--nproc-per-node {tp * pp * cp * dp}".split(),
        *extra,
    ]
    result = run_pretrain(args, tmp_path)
    assert result.returncode == 0, result.stderr
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, ITERS + 1)), result.stdout
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("ref"), 1, 1, 1)


@pytest.mark.world
def test_single_process_loss_falls(reference):
    assert reference[ITERS] < reference[1] - 0.05


@pytest.mark.world
@pytest.mark.parametrize(
    "tp,pp,dp,cp", [(1, 4, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 2, 1), (1, 2, 1, 2), (1, 1, 2, 2)]
)
def test_loss_matches_single_process(tmp_path, reference, tp, pp, dp, cp):
    losses = _losses(tmp_path, tp, pp, dp, cp=cp)
    for it in range(1, ITERS + 1):
        assert abs(losses[it] - reference[it]) <= 5e-4 * abs(reference[it]), (it, losses[it], reference[it])
    assert losses[ITERS] < losses[1]


@pytest.mark.world
def test_untied_embeddings_parity(tmp_path):
    untie = ["--untie-embeddings-and-output-weights"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    single = _losses(tmp_path / "a", 1, 1, 1, untie)
    pipelined = _losses(tmp_path / "b", 1, 2, 1, untie)
    for it in range(1, ITERS + 1):
        assert abs(pipelined[it] - single[it]) <= 5e-4 * abs(single[it])


@pytest.mark.world
def test_bf16_trains_with_fp32_masters_close_to_fp32(tmp_path, reference):
    bf16 = _losses(tmp_path, 1, 2, 1, ["--bf16"])
    assert bf16[ITERS] < bf16[1]
    for it in range(1, ITERS + 1):
        assert abs(bf16[it] - reference[it]) <= 2e-2 * reference[it]


# Llama-shaped: rotary positions, RMSNorm, SwiGLU, two key/value groups for four heads, untied, no biases.
LLAMA = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --ffn-hidden-size 96 "
    "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
    "--disable-bias-linear"
).split()


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("llama_ref"), 1, 1, 1, LLAMA)


@pytest.mark.world
@pytest.mark.parametrize(
    "tp,pp,dp,cp", [(2, 1, 1, 1), (1, 4, 1, 1), (2, 2, 1, 1), (1, 2, 1, 2), (1, 1, 2, 1)]
)
def test_llama_shaped_loss_matches_single_process(tmp_path, llama_reference, tp, pp, dp, cp):
    losses = _losses(tmp_path, tp, pp, dp, LLAMA, cp=cp)
    for it in range(1, ITERS + 1):
        ref = llama_reference[it]
        assert abs(losses[it] - ref) <= 5e-4 * abs(ref), (it, losses[it], ref)
    assert losses[ITERS] < losses[1]


@pytest.mark.world
def test_llama_shaped_loss_differs_from_gpt2_shaped(llama_reference, reference):
    """The flags change the model: the same seed and data give another loss curve."""
    assert abs(llama_reference[ITERS] - reference[ITERS]) > 1e-3


@pytest.mark.world
def test_llama_shaped_with_dropout_trains_under_tp_and_cp(tmp_path, llama_reference):
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    losses = _losses(tmp_path, 2, 1, 1, [*LLAMA, *dropout], cp=2)
    assert all(loss == loss for loss in losses.values())  # no NaN
    assert losses[ITERS] < losses[1]
    assert losses != llama_reference  # the masks did act


@pytest.mark.world
@pytest.mark.parametrize("tp,pp,cp", [(2, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_sequence_parallel_loss_matches_single_process(tmp_path, reference, tp, pp, cp):
    losses = _losses(tmp_path, tp, pp, 1, ["--sequence-parallel"], cp=cp)
    for it in range(1, ITERS + 1):
        assert abs(losses[it] - reference[it]) <= 5e-4 * abs(reference[it]), (it, losses[it], reference[it])
