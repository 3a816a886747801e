"""LoRA on routed experts at one process: SequentialMLP's experts each get an adapter, TEGroupedMLP's
local experts share one (Bridge's default) or get one each (``share_expert_adapters=False``); the
expert adapters are reduced over the expert data-parallel group like the expert weights, and
folding them into the experts' weights leaves the layer's output unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lora_case_helpers import randomize_adapters

from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.moe.moe_layer import MoELayer
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.utils import seeded_init
from megatron_lite.peft import GroupedExpertLinearAdapter, LoRA, LoRALinear, ParallelLinearAdapter
from megatron_lite.peft.lora_merge import merge_lora_model

H = 16


def _moe_layer(grouped: bool) -> MoELayer:
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=4,
        moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        moe_shared_expert_intermediate_size=16, moe_grouped_gemm=grouped,
    )  # fmt: skip
    with seeded_init(7, "layer 0"):
        return MoELayer(
            config, layer_number=1, pg_collection=ProcessGroupCollection(), seed=7,
            init_method=config.init_method, output_layer_init_method=config.output_layer_init_method,
        )  # fmt: skip


def _wrapped(layer) -> dict[str, LoRALinear]:
    return {n: m for n, m in layer.named_modules() if isinstance(m, LoRALinear)}


def test_sequential_experts_each_get_an_expert_adapter():
    layer = LoRA(dim=4, alpha=8)(_moe_layer(grouped=False))
    wrapped = _wrapped(layer)
    names = sorted(n for n in wrapped if n.startswith("experts."))
    assert names == sorted(f"experts.local_experts.{i}.linear_fc{j}" for i in range(4) for j in (1, 2))
    assert "shared_experts.linear_fc1" in wrapped
    for name, module in wrapped.items():
        expert = name.startswith("experts.")
        assert module.adapter.is_expert is expert
        assert all(p.allreduce is not expert for p in module.adapter.parameters()), name
    # Each expert draws its own adapter.
    a0 = wrapped["experts.local_experts.0.linear_fc1"].adapter.linear_in.weight
    a1 = wrapped["experts.local_experts.1.linear_fc1"].adapter.linear_in.weight
    assert not torch.equal(a0, a1)


def test_grouped_experts_share_one_adapter_by_default():
    layer = LoRA(dim=4, alpha=8)(_moe_layer(grouped=True))
    fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
    assert isinstance(fc1, LoRALinear) and isinstance(fc1.adapter, ParallelLinearAdapter)
    assert tuple(fc1.adapter.linear_in.weight.shape) == (4, H)
    assert tuple(fc1.adapter.linear_out.weight.shape) == (2 * 32, 4)
    assert tuple(fc2.adapter.linear_in.weight.shape) == (4, 32)
    assert tuple(fc2.adapter.linear_out.weight.shape) == (H, 4)
    assert "experts.linear_fc1.adapter.linear_in.weight" in layer.state_dict()
    assert "experts.linear_fc1.weight0" in layer.state_dict()


def test_grouped_experts_get_one_adapter_each_when_not_shared():
    layer = LoRA(dim=4, alpha=8, share_expert_adapters=False)(_moe_layer(grouped=True))
    fc1 = layer.experts.linear_fc1
    assert isinstance(fc1.adapter, GroupedExpertLinearAdapter)
    assert tuple(fc1.adapter.linear_in.weight.shape) == (4, 4, H)
    assert tuple(fc1.adapter.linear_out.weight.shape) == (4, 64, 4)
    assert not fc1.adapter.linear_in.weight.allreduce


@pytest.mark.parametrize("shared", [True, False])
def test_grouped_expert_linear_adds_each_experts_lora_by_hand(shared):
    layer = LoRA(dim=4, alpha=8, share_expert_adapters=shared)(_moe_layer(grouped=True))
    randomize_adapters(layer)
    fc1 = layer.experts.linear_fc1
    rows = [3, 0, 5, 2]
    x = torch.randn(sum(rows), H)
    expected = []
    for e, part in enumerate(x.split(rows)):
        a = fc1.adapter.linear_in.weight if shared else fc1.adapter.linear_in.weight[e]
        b = fc1.adapter.linear_out.weight if shared else fc1.adapter.linear_out.weight[e]
        expected.append(part @ fc1.to_wrap.weights()[e].t() + 2.0 * part @ a.t() @ b.t())
    torch.testing.assert_close(fc1(x, rows), torch.cat(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grouped, shared", [(False, True), (True, True), (True, False)])
def test_zero_b_gives_the_base_layer_and_merging_gives_the_lora_layer(grouped, shared):
    torch.manual_seed(0)
    hidden = torch.randn(8, 2, H)
    base_out = _moe_layer(grouped)(hidden)
    layer = LoRA(dim=4, alpha=8, share_expert_adapters=shared)(_moe_layer(grouped))
    torch.testing.assert_close(layer(hidden), base_out, rtol=0, atol=0)
    randomize_adapters(layer)
    lora_out = layer(hidden)
    assert (lora_out - base_out).abs().max() > 1e-3
    merge_lora_model(layer)
    assert not _wrapped(layer)
    torch.testing.assert_close(layer(hidden), lora_out, rtol=1e-5, atol=1e-6)


def test_expert_adapters_get_gradients():
    layer = LoRA(dim=4, alpha=8, share_expert_adapters=False)(_moe_layer(grouped=True))
    randomize_adapters(layer)
    layer(torch.randn(8, 2, H)).sum().backward()
    trainable = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())


@pytest.mark.parametrize("shared", [True, False])
def test_expert_adapter_weights_pass_their_modules_forward_pre_hooks(shared):
    # DDP's overlapped parameter gather waits for a parameter's update in such a hook.
    layer = LoRA(dim=4, alpha=8, share_expert_adapters=shared)(_moe_layer(grouped=True))
    adapter = layer.experts.linear_fc2.adapter
    seen = []
    for part in (adapter.linear_in, adapter.linear_out):
        part.register_forward_pre_hook(lambda module, args: seen.append(module))
    layer(torch.randn(8, 2, H))
    assert seen == [adapter.linear_in, adapter.linear_out]
