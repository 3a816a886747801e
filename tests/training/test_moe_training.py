"""Mixture of experts trains as one process does under every expert-parallel layout (loss parity over
8 iterations), and its dashboards count the tokens the routers sent."""

from __future__ import annotations

import pytest
from dist_helpers import SMALL_MODEL, parse_losses, run_pretrain
from event_files import scalars

pytestmark = pytest.mark.world  # every test here starts processes

ITERS = 8

# Llama-shaped MoE: 4 experts, top-2, a load-balancing and a z loss, a shared expert.
MOE = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
    "--moe-aux-loss-coeff 1.0 --moe-z-loss-coeff 0.1 --moe-shared-expert-intermediate-size 32"
).split()


def _run(tmp_path, nproc: int, extra: str = "", *, logdir=None):
    args = [
        *SMALL_MODEL,
        *MOE,
        *f"--train-iters {ITERS} --seed 1234 --nproc-per-node {nproc}".split(),
        *extra.split(),
    ]
    if logdir is not None:
        args += ["--tensorboard-dir", str(logdir)]
    result = run_pretrain(args, tmp_path)
    assert result.returncode == 0, result.stderr
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, ITERS + 1)), result.stdout
    return losses, result.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ref")
    return (*_run(tmp, 1, "--moe-grouped-gemm", logdir=tmp / "tb"), tmp / "tb")


def _assert_parity(losses, reference_losses):
    for it in range(1, ITERS + 1):
        ref = reference_losses[it]
        assert abs(losses[it] - ref) <= 5e-4 * abs(ref), (it, losses[it], ref)


def test_one_process_moe_trains_and_logs_its_aux_losses(reference):
    losses, stdout, _ = reference
    assert losses[ITERS] < losses[1] - 0.05
    assert "load_balancing_loss:" in stdout and "z_loss:" in stdout


LAYOUTS = {
    "ep2-allgather-sequential": (2, "--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"),
    "ep2-tp2-etp1": (
        4,
        "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 "
        "--sequence-parallel --moe-token-dispatcher-type alltoall --moe-grouped-gemm",
    ),
    "ep2-tp2-etp2": (
        4,
        "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 "
        "--sequence-parallel --moe-token-dispatcher-type allgather --moe-grouped-gemm",
    ),
    "ep2-pp2": (
        4,
        "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
    ),
    "ep2-cp2": (
        2,
        "--expert-model-parallel-size 2 --context-parallel-size 2 --moe-token-dispatcher-type alltoall",
    ),
    "ep2-dp2-distopt": (
        4,
        "--expert-model-parallel-size 2 --use-distributed-optimizer --moe-token-dispatcher-type alltoall "
        "--moe-grouped-gemm",
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_matches_one_process(tmp_path, reference, layout):
    nproc, flags = LAYOUTS[layout]
    losses, _ = _run(tmp_path, nproc, flags)
    _assert_parity(losses, reference[0])


def test_ep2_alltoall_matches_one_process_and_its_dashboards_count_the_routers_tokens(tmp_path, reference):
    """Loss parity at EP 2 over the all-to-all dispatcher, and every expert's count on its dashboard,
    at every step, is what the routers sent it: the same whether the experts live on one rank or two
    (identical weights at step 1, so identical routing), and all of a layer's counts add up to the
    tokens of the global batch times top-k."""
    ref_losses, _, ref_tb = reference
    losses, _ = _run(
        tmp_path,
        2,
        "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
        logdir=tmp_path / "tb",
    )
    _assert_parity(losses, ref_losses)
    ep2, one = scalars(tmp_path / "tb"), scalars(ref_tb)
    tags = [t for t in one if t.startswith("moe/tokens_per_expert/")]
    assert len(tags) == 4 * 4  # every layer is MoE, 4 experts each
    tokens = 8 * 32 * 2  # global batch x sequence x top-k
    for layer in range(1, 5):
        per_step = [one[f"moe/tokens_per_expert/layer_{layer}/expert_{e}"] for e in range(4)]
        for step in range(1, ITERS + 1):
            assert sum(counts[step] for counts in per_step) == tokens
    for tag in tags:
        assert ep2[tag][1] == one[tag][1], tag
    imbalance = one["moe/tokens_imbalance/layer_1"][1]
    counts = [one[f"moe/tokens_per_expert/layer_1/expert_{e}"][1] for e in range(4)]
    assert imbalance == pytest.approx(max(counts) / (sum(counts) / 4))
    assert "load_balancing_loss" in one and "z_loss" in one
