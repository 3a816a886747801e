"""Folding LoRA into the base weights (Megatron-Bridge's LoRAMerge): the merged model computes what
the LoRA model computes, and merge_lora_model gives back the plain base layers and keys."""

from __future__ import annotations

import torch
from lora_case_helpers import randomize_adapters, tiny_gpt, tokens_and_positions

from megatron_lite.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.peft import LoRA, LoRALinear, LoRAMerge
from megatron_lite.peft.lora_merge import merge_lora_model


def test_merge_is_base_plus_scaled_b_a():
    g = torch.Generator().manual_seed(0)
    w, b, a = (torch.randn(s, generator=g) for s in ((12, 10), (12, 4), (4, 10)))
    merged = LoRAMerge().merge(w, b, a, alpha=8, dim=4, tp_group=None)
    torch.testing.assert_close(merged, w + 2.0 * b @ a)
    torch.testing.assert_close(LoRAMerge().merge(w, b, a, 8, 4, tp_group=None, scale=0.5), w + 0.5 * b @ a)


def test_lora_linear_weight_is_the_merged_weight_while_enabled():
    torch.manual_seed(0)
    [model] = LoRA(dim=4, alpha=8)([tiny_gpt()])
    randomize_adapters(model)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    a, b = qkv.adapter.linear_in.weight, qkv.adapter.linear_out.weight
    torch.testing.assert_close(qkv.weight, qkv.to_wrap.weight + 2.0 * b @ a)
    qkv.disable_adapter_layers()
    assert qkv.weight is qkv.to_wrap.weight


def test_merged_model_equals_the_lora_model():
    torch.manual_seed(0)
    base = tiny_gpt()
    base_keys = set(base.state_dict())
    [model] = LoRA(dim=8, alpha=16)([base])
    randomize_adapters(model)
    model.eval()
    tokens, positions = tokens_and_positions()
    lora_logits = model(tokens, positions)
    chunks = merge_lora_model([model])
    assert chunks[0] is model
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert isinstance(model.decoder.layers[0].self_attention.linear_qkv, ColumnParallelLinear)
    assert isinstance(model.decoder.layers[1].mlp.linear_fc2, RowParallelLinear)
    assert set(model.state_dict()) == base_keys
    merged_logits = model(tokens, positions)
    assert ((merged_logits - lora_logits).abs().max() / lora_logits.abs().max()).item() < 1e-6


def test_each_merged_layer_equals_its_lora_forward():
    torch.manual_seed(0)
    [model] = LoRA(dim=8, alpha=16)([tiny_gpt()])
    randomize_adapters(model)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    x = {n: torch.randn(4, 2, m.to_wrap.input_size) for n, m in layers.items()}
    before = {n: m(x[n])[0] for n, m in layers.items()}
    merge_lora_model(model)
    for name, module in model.named_modules():
        if name in before:
            torch.testing.assert_close(module(x[name])[0], before[name], rtol=0, atol=1e-6)
