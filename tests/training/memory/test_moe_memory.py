"""MoE memory: what a MoE layer saves for the rows its experts take, each stage's prediction against a
real pp 2 x ep 2 run (exact with padding to capacity; bounded by the worst routing without), and the
attribution's first step (the dry run against the same runs: test_moe_dry_run.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import SMALL_MOE_JOB
from memory_measure import measure

from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.moe.moe_layer import MoELayer
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.training.arguments import parse_args
from megatron_lite.training.memory.predict.activations import Shape
from megatron_lite.training.memory.predict.moe import moe_mlp_saves
from megatron_lite.training.memory.predict.stages import predict_memory_per_stage
from megatron_lite.training.memory.saved_tensors import ActivationMemoryTracker

S, B, H = 32, 2, 64
PADDED = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
LAYERS = {
    "alltoall-grouped-bias": dict(moe_grouped_gemm=True),
    "alltoall-sequential": dict(add_bias_linear=False),
    "alltoall-grouped-padded": dict(moe_grouped_gemm=True, add_bias_linear=False, **PADDED),
    "allgather-swiglu-padded": dict(
        moe_token_dispatcher_type="allgather", gated_linear_unit=True, activation_func=F.silu, **PADDED
    ),
    "shared-expert-gate": dict(
        moe_grouped_gemm=True, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, **PADDED
    ),
}


def _saved_by_one_moe_layer(overrides) -> tuple[int, int, TransformerConfig]:
    """(bytes the layer's forward saved beyond its input, rows its experts took, its config)."""
    fields = dict(
        num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=128, num_moe_experts=4,
        moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="alltoall",
    )  # fmt: skip
    config = TransformerConfig(**{**fields, **overrides})
    layer = MoELayer(
        config, layer_number=1, pg_collection=ProcessGroupCollection(), seed=7,
        init_method=config.init_method, output_layer_init_method=config.output_layer_init_method,
    )  # fmt: skip
    tracker = ActivationMemoryTracker()
    tracker.exclude_parameters(layer.parameters())
    x = torch.randn(S, B, H, requires_grad=True)
    with tracker.track():
        out = layer(x)
    saved = tracker.current_bytes - S * B * H * 4  # the input: the layer's norm output, counted there
    rows = int(layer.token_dispatcher.tokens_per_expert.sum())
    out.sum().backward()
    return saved, rows, config


@pytest.mark.parametrize("name", list(LAYERS))
def test_one_moe_layer_saves_what_the_count_says_for_the_rows_it_routed(name, monkeypatch):
    """Exact to the byte for the rows the router really sent (the count for that routing)."""
    import megatron_lite.training.memory.predict.moe as moe

    saved, rows, config = _saved_by_one_moe_layer(LAYERS[name])
    monkeypatch.setattr(moe, "routed_rows", lambda m, tokens, routing: (rows, rows))
    predicted = sum(moe_mlp_saves(Shape(S * B, S * B, S, S, B, 4, config)).values())
    assert saved == predicted


def test_padded_capacity_fixes_the_rows_and_open_routing_stays_under_the_worst_bound():
    _, padded_rows, config = _saved_by_one_moe_layer(LAYERS["alltoall-grouped-padded"])
    assert moe.routed_rows(config, S * B)[0] == padded_rows == 4 * 32  # E experts x capacity, exactly
    saved, rows, config = _saved_by_one_moe_layer(LAYERS["alltoall-sequential"])
    x = Shape(S * B, S * B, S, S, B, 4, config)
    worst = sum(moe_mlp_saves(x, "worst").values())
    assert rows <= moe.routed_rows(config, S * B, "worst")[0] and saved <= worst


import megatron_lite.training.memory.predict.moe as moe  # noqa: E402  (the module the test above patches)


@pytest.mark.world
def test_with_padded_capacity_every_stage_matches_its_measured_activations_within_3_percent(tmp_path):
    argv = [*SMALL_MOE_JOB, "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
    stages = measure(argv, 4, tmp_path, quiet=True)
    for stage, s in enumerate(stages):
        for quantity in ("weights", "grads", "optimizer"):
            measured, predicted = s[quantity]
            assert predicted == pytest.approx(measured, rel=1e-3), (stage, quantity)
        measured, predicted = s["activations"]
        assert abs(predicted / measured - 1) <= 0.03, (stage, measured, predicted)


@pytest.mark.world
def test_without_capacity_each_stage_stays_under_the_worst_routing_bound(tmp_path):
    stages = measure(SMALL_MOE_JOB, 4, tmp_path, quiet=True)
    predictions = predict_memory_per_stage(parse_args(SMALL_MOE_JOB))
    for stage, (s, p) in enumerate(zip(stages, predictions)):
        measured, balanced = s["activations"]
        worst = p.activation_bytes_worst / 1e9
        assert balanced < worst
        # The bound holds on every rank. The stage's value is its worst EP rank's (a MAX over the
        # expert-parallel group): the EP ranks' rows add up to the balanced rows times ep, so the worst
        # takes at least the balanced share (1%: the prediction's own error on the rest).
        assert measured <= worst * 1.001, (stage, measured, balanced, worst)
        assert measured >= balanced * 0.99, (stage, measured, balanced)


def test_first_step_other_peak_is_the_rest_at_the_peak_instant_never_negative():
    """The optimizer state is made after the first step's activation peak: on the CPU the rest at the
    peak is the tracker's make-up of that instant, not "peak - static now - activation peak"."""
    from megatron_lite.training.memory.attribution import other_memory_stats

    stats = {
        "weights_bytes.current": 100, "grads_bytes.current": 100, "optimizer_state_bytes.current": 200,
        "activation_bytes.current": 0, "activation_bytes.peak": 300,
        "allocated_bytes.all.current": 410, "allocated_bytes.all.peak": 540, "temporaries_bytes.peak": 40,
    }  # fmt: skip
    assert other_memory_stats(stats)["other_bytes.peak"] == 40
    cuda = {k: v for k, v in stats.items() if k != "temporaries_bytes.peak"}
    assert other_memory_stats(cuda)["other_bytes.peak"] == 0
