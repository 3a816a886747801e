"""Checkpoints of mixture-of-experts models: the legacy ``torch`` format names each expert-parallel
rank's file ``mp_rank_XX_YYY`` and resumes at its saved layout only; ``torch_dist`` writes the experts
at megatron-core's global keys, so a checkpoint saved at ep 2 (grouped experts, distributed optimizer)
resumes at ep 1, ep 4 and another expert-TP size, with grouped or sequential experts, with the losses
of the unbroken run; so does one of sequential experts in dense and MoE layers mixed (upstream's
non-homogeneous layers, one key per layer) with a gated shared expert, resumed with grouped experts.
Real gloo worlds, real files."""

from __future__ import annotations

import pytest
from dist_helpers import SMALL_MODEL, loss_lines, ok, parse_losses, run_pretrain

from megatron_lite.core.dist_checkpointing import load_metadata

pytestmark = pytest.mark.world  # every test here starts processes

MOE = [
    *SMALL_MODEL,
    *("--train-iters", "6", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"),
    *("--moe-token-dispatcher-type", "alltoall", "--swiglu", "--disable-bias-linear"),
]
EP2 = ["--expert-model-parallel-size", "2", "--nproc-per-node", "2", "--moe-grouped-gemm"]
DIST_OPT = ["--use-distributed-optimizer"]
TP2_EP2 = [
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--expert-model-parallel-size",
    "2",
    "--nproc-per-node",
    "4",
]


def _assert_close(resumed: dict, reference: dict, iterations) -> None:
    assert sorted(resumed) == list(iterations)
    for it in iterations:
        assert abs(resumed[it] - reference[it]) <= 5e-4 * abs(reference[it]), (it, resumed[it], reference[it])


@pytest.fixture(scope="module")
def legacy_ep2(tmp_path_factory):
    """6 iterations at ep 2 with the distributed optimizer in --ckpt-format torch, saving 3 and 6."""
    root = tmp_path_factory.mktemp("moe_torch")
    straight = ok(run_pretrain([*MOE, *EP2, *DIST_OPT, "--save", "ckpt", "--save-interval", "3"], root))
    return root, loss_lines(straight.stdout)


def test_legacy_files_are_named_per_expert_parallel_rank(legacy_ep2):
    root, _ = legacy_ep2
    step = root / "ckpt" / "iter_0000003"
    assert sorted(p.name for p in step.iterdir()) == ["metadata.json", "mp_rank_00_000", "mp_rank_00_001"]
    assert sorted(p.name for p in (step / "mp_rank_00_001").iterdir()) == [
        "distrib_optim.pt",
        "model_optim_rng.pt",
    ]


def test_legacy_resume_at_the_saved_layout_reproduces_the_losses(legacy_ep2):
    root, reference = legacy_ep2
    resumed = ok(run_pretrain([*MOE, *EP2, *DIST_OPT, "--load", "ckpt", "--ckpt-step", "3"], root))
    assert loss_lines(resumed.stdout) == {it: reference[it] for it in range(4, 7)}


def test_legacy_refuses_another_expert_parallel_size(legacy_ep2):
    root, _ = legacy_ep2
    args = [*MOE, *DIST_OPT, "--nproc-per-node", "2", "--load", "ckpt", "--ckpt-step", "3"]
    refused = run_pretrain(args, root)
    assert refused.returncode != 0
    assert "saved with expert-parallel size 2, expert tensor-parallel size 1 but this run uses 1, 1" in (
        refused.stdout + refused.stderr
    )
    assert "--ckpt-format torch_dist" in refused.stdout + refused.stderr


@pytest.fixture(scope="module")
def dist_tp2_ep2(tmp_path_factory):
    """6 iterations at tp 2 ep 2 (expert TP 2), grouped experts and the distributed optimizer, in
    --ckpt-format torch_dist, saving 3 and 6."""
    root = tmp_path_factory.mktemp("moe_dist")
    args = [*MOE, *TP2_EP2, "--moe-grouped-gemm", *DIST_OPT, "--ckpt-format", "torch_dist"]
    straight = ok(run_pretrain([*args, "--save", "ckpt", "--save-interval", "3"], root))
    return root, parse_losses(straight.stdout)


def test_experts_are_saved_at_megatron_core_keys(dist_tp2_ep2):
    root, _ = dist_tp2_ep2
    saved = load_metadata(str(root / "ckpt" / "iter_0000003")).state_dict_metadata
    # [layer, global expert, rows, columns], expert-TP shards merged ([gate; value]); the router whole.
    assert tuple(saved["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (4, 4, 256, 64)
    assert tuple(saved["decoder.layers.mlp.experts.experts.linear_fc2.weight"].size) == (4, 4, 64, 128)
    assert tuple(saved["decoder.layers.mlp.router.weight"].size) == (4, 4, 64)
    assert tuple(saved["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (
        4, 4, 256, 64,
    )  # fmt: skip
    assert "decoder.layers.pre_mlp_layernorm.weight" in saved


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(["--nproc-per-node", "2"], id="ep1-sequential-no-distributed-optimizer"),
        pytest.param(["--expert-model-parallel-size", "4", "--nproc-per-node", "4", "--moe-grouped-gemm", *DIST_OPT], id="ep4-grouped"),
        pytest.param([*TP2_EP2, "--expert-tensor-parallel-size", "1", *DIST_OPT], id="tp2-etp1-sequential"),
    ],
)  # fmt: skip
def test_torch_dist_resumes_at_another_expert_layout(dist_tp2_ep2, layout):
    root, reference = dist_tp2_ep2
    args = [*MOE, *layout, "--ckpt-format", "torch_dist", "--load", "ckpt", "--ckpt-step", "3"]
    resumed = ok(run_pretrain(args, root))
    assert "resharding checkpoint from tp=2" in resumed.stdout
    _assert_close(parse_losses(resumed.stdout), reference, range(4, 7))


MIXED = [
    *MOE,
    *("--moe-layer-freq", "2", "--moe-shared-expert-intermediate-size", "96", "--moe-shared-expert-gate"),
    *("--ckpt-format", "torch_dist", *DIST_OPT),
]


@pytest.fixture(scope="module")
def dist_mixed_ep2(tmp_path_factory):
    """6 iterations of MIXED at ep 2 with sequential experts in --ckpt-format torch_dist, saving 3 and 6:
    layers 0 and 2 MoE with a gated shared expert, layers 1 and 3 dense."""
    root = tmp_path_factory.mktemp("moe_mixed")
    args = [*MIXED, "--expert-model-parallel-size", "2", "--nproc-per-node", "2"]
    straight = ok(run_pretrain([*args, "--save", "ckpt", "--save-interval", "3"], root))
    return root, parse_losses(straight.stdout)


def test_mixed_dense_and_moe_layers_are_saved_one_key_per_layer(dist_mixed_ep2):
    root, _ = dist_mixed_ep2
    saved = load_metadata(str(root / "ckpt" / "iter_0000003")).state_dict_metadata
    assert tuple(saved["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"].size) == (4, 256, 64)
    assert tuple(saved["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"].size) == (192, 64)
    assert tuple(saved["decoder.layers.2.mlp.shared_experts.gate_weight"].size) == (1, 64)
    assert "decoder.layers.2.pre_mlp_layernorm.weight" in saved
    # A dense layer's norm is fused into its fc1, as in upstream's Transformer Engine layers.
    assert tuple(saved["decoder.layers.3.mlp.linear_fc1.weight"].size) == (256, 64)
    assert "decoder.layers.3.mlp.linear_fc1.layer_norm_weight" in saved
    assert not any(key.startswith("decoder.layers.mlp.") for key in saved)


def test_grouped_experts_resume_a_sequential_mixed_checkpoint_at_another_expert_parallel_size(
    dist_mixed_ep2,
):
    root, reference = dist_mixed_ep2
    args = [*MIXED, "--nproc-per-node", "2", "--moe-grouped-gemm", "--load", "ckpt", "--ckpt-step", "3"]
    resumed = ok(run_pretrain(args, root))
    assert (
        "resharding checkpoint from tp=1 pp=1 dp=2 ep=2 etp=1 to tp=1 pp=1 dp=2 ep=1 etp=1" in resumed.stdout
    )
    _assert_close(parse_losses(resumed.stdout), reference, range(4, 7))
