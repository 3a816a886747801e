"""The MoE layer: the router's arithmetic by hand, and the layer under expert parallelism (both
dispatchers, expert tensor parallelism, sequence parallelism) against one process, in real gloo worlds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import run_world

from megatron_lite.core import parallel_state
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.moe.moe_layer import MoELayer, moe_layer_pattern
from megatron_lite.core.transformer.moe.moe_utils import (
    apply_router_token_dropping,
    get_capacity,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
)
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.utils import seeded_init


def test_topk_softmax_after_topk_renormalises_the_chosen_experts():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs, routing_map = topk_routing_with_score_function(logits, 2)
    assert routing_map.tolist() == [[False, True, True, False]]
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(probs[0, 1:3], e / e.sum())
    pre, _ = topk_routing_with_score_function(logits, 2, use_pre_softmax=True)
    torch.testing.assert_close(pre[0, 1:3], torch.softmax(logits[0], -1)[1:3])
    sig, _ = topk_routing_with_score_function(logits, 2, score_function="sigmoid")
    s = torch.sigmoid(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(sig[0, 1:3], s / s.sum())


def test_capacity_drops_the_lowest_probabilities_or_the_latest_tokens():
    # Four tokens all choosing expert 0 of two, top-1: capacity ceil(4 / 2 * 1.0) = 2.
    probs = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.7, 0.0], [0.8, 0.0]])
    routing_map = probs > 0
    assert get_capacity(4, 2, 1.0) == 2
    _, kept = apply_router_token_dropping(probs, routing_map, 1, 1.0, "probs")
    assert kept[:, 0].tolist() == [False, True, False, True]
    _, kept = apply_router_token_dropping(probs, routing_map, 1, 1.0, "position")
    assert kept[:, 0].tolist() == [True, True, False, False]
    padded_probs, padded = apply_router_token_dropping(
        probs, routing_map, 1, 1.0, "probs", pad_to_capacity=True
    )
    assert padded.sum(0).tolist() == [2, 2]  # every expert exactly at capacity
    assert padded_probs[:, 1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_load_balancing_loss_is_switch_transformers():
    probs = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.8, 0.2]])
    tokens = torch.tensor([2.0, 1.0])
    loss = switch_load_balancing_loss_func(probs, tokens, 3, 1, 2, 0.1)
    f = tokens / 3
    p = probs.mean(0)
    torch.testing.assert_close(loss, 0.1 * 2 * (f * p).sum())


def test_moe_layer_freq_patterns():
    config = TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=2, num_moe_experts=2)
    assert moe_layer_pattern(config) == [1, 1, 1, 1]
    config.moe_layer_freq = 2
    assert moe_layer_pattern(config) == [1, 0, 1, 0]
    config.moe_layer_freq = [0, 1, 1, 0]
    assert moe_layer_pattern(config) == [0, 1, 1, 0]


S, B, H = 8, 4, 16


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=4,
        moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
    )  # fmt: skip
    fields.update(overrides)
    return TransformerConfig(**fields)


def _layer(config, pg_collection):
    with seeded_init(7, "layer 0"):  # the router and shared expert, as TransformerBlock draws them
        return MoELayer(
            config, layer_number=1, pg_collection=pg_collection, seed=7, init_method=config.init_method,
            output_layer_init_method=config.output_layer_init_method,
        )  # fmt: skip


def _reference(config):
    torch.manual_seed(0)
    hidden = torch.randn(S, B, H, requires_grad=True)
    weights = torch.randn(S, B, H)
    layer = _layer(config, ProcessGroupCollection())
    out = layer(hidden)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return hidden.detach(), weights, out.detach(), hidden.grad.clone(), grads


def _layer_on_rank(rank, world, tp, ep, etp, overrides):
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    try:
        sp = tp > 1
        config = _config(sequence_parallel=sp, tensor_model_parallel_size=tp, **overrides)
        hidden, weights, ref_out, ref_hidden_grad, ref_grads = _reference(_config(**overrides))
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # This rank's part: its data-parallel share of the batch, its TP share of the sequence.
        part = lambda t: t.chunk(dp, dim=1)[dp_rank].chunk(tp, dim=0)[tp_rank]  # noqa: E731
        x = part(hidden).clone().requires_grad_(True)
        layer = _layer(config, ProcessGroupCollection.use_mpu_process_groups())
        out = layer(x)
        (out * part(weights)).sum().backward()
        torch.testing.assert_close(out, part(ref_out), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.grad, part(ref_hidden_grad), rtol=1e-5, atol=1e-6)
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        offset = parallel_state.get_expert_model_parallel_rank() * (4 // ep)
        checked = 0
        for name, p in layer.named_parameters():
            if not name.startswith("experts."):
                continue
            local = int(name[-1])
            ref = ref_grads[name[:-1] + str(local + offset)]
            if name.startswith("experts.linear_fc1"):  # gated: [gate; value] rows, each split over etp
                gate, value = ref.chunk(2, dim=0)
                ref = torch.cat([gate.chunk(etp)[etp_rank], value.chunk(etp)[etp_rank]])
            else:
                ref = ref.chunk(etp, dim=1)[etp_rank]
            # Each expert replica saw its expert-parallel group's tokens: together, all of them.
            torch.distributed.all_reduce(p.grad, group=parallel_state.get_expert_data_parallel_group())
            torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-6)
            checked += 1
        return checked
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.world
@pytest.mark.parametrize(
    "tp,ep,etp,dispatcher",
    [
        (1, 2, 1, "alltoall"),
        (1, 4, 1, "allgather"),
        (2, 2, 1, "alltoall"),
        (2, 2, 2, "alltoall"),
        (2, 2, 2, "allgather"),
    ],
)
def test_moe_layer_matches_one_process(tp, ep, etp, dispatcher):
    overrides = {"moe_token_dispatcher_type": dispatcher, "moe_grouped_gemm": True}
    checked = run_world(_layer_on_rank, 4, tp, ep, etp, overrides)
    assert all(c == 2 * 4 // ep for c in checked)


def test_flops_count_the_topk_experts_and_the_shared_expert():
    from types import SimpleNamespace

    from megatron_lite.models.gpt_provider import GPTModelProvider
    from megatron_lite.training.utils.flop_utils import num_floating_point_operations

    shape = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256)
    dense = num_floating_point_operations(SimpleNamespace(model=GPTModelProvider(**shape)), 8)
    moe = GPTModelProvider(
        **shape, num_moe_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=32
    )
    flops = num_floating_point_operations(SimpleNamespace(model=moe), 8)
    # Per token and MoE layer: a second expert (ffn 256) and the shared expert (32), fc1 + fc2,
    # 2 FLOPs per multiply-add, x3 for backward; 4 layers, 8 x 32 tokens.
    assert flops - dense == 3 * 2 * 4 * 2 * 64 * (256 + 32) * 8 * 32


def test_the_metrics_tracker_starts_afresh_for_another_model():
    from megatron_lite.core.transformer.moe.moe_logging import MoEMetricsTracker

    tracker = MoEMetricsTracker()
    tracker.record_tokens(torch.tensor([1, 2]), layer_number=2, num_layers=2)
    tracker.record("load_balancing_loss", torch.tensor(1.0), layer_number=2, num_layers=2)
    # A deeper model in the same process (a dry run after a test, a second run from Python).
    tracker.record_tokens(torch.tensor([3, 4, 5]), layer_number=4, num_layers=4)
    tracker.record("load_balancing_loss", torch.tensor(2.0), layer_number=4, num_layers=4)
    assert tracker.tokens[3].tolist() == [3, 4, 5] and tracker.tokens[:3].sum() == 0
    assert tracker.losses["load_balancing_loss"].tolist() == [0, 0, 0, 2]


def test_grouped_linear_matches_per_expert_gemms_with_empty_experts_and_no_tokens():
    from megatron_lite.core.transformer.moe.experts import grouped_linear

    torch.manual_seed(0)
    for rows in ([3, 0, 5, 4], [0, 0, 0, 0]):
        x = torch.randn(sum(rows), 16, requires_grad=True)
        weights = [torch.randn(32, 16, requires_grad=True) for _ in rows]
        out = grouped_linear(x, weights, None, rows)
        grad = torch.randn(1, 32).expand(sum(rows), 32)  # stride 0, as sum().backward() gives
        out.backward(grad)
        ref_x = x.detach().clone().requires_grad_(True)
        ref_w = [w.detach().clone().requires_grad_(True) for w in weights]
        ref = torch.cat([p @ w.t() for p, w in zip(ref_x.split(rows), ref_w)])
        ref.backward(grad)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(x.grad, ref_x.grad)
        for w, r in zip(weights, ref_w):
            torch.testing.assert_close(w.grad, r.grad)
