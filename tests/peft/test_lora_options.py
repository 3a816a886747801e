"""LoRA's options at one process: dropout before A or after B, the init methods of A and B, the
adapters' dtype, and adapters drawn the same whatever the model's global RNG does."""

from __future__ import annotations

import math

import pytest
import torch
from lora_case_helpers import randomize_adapters, tiny_gpt

from megatron_lite.peft import LoRA


def _layer(**fields):
    torch.manual_seed(0)
    [model] = LoRA(dim=8, alpha=16, **fields)([tiny_gpt()])
    return model.decoder.layers[0].mlp.linear_fc1


def _adapter_delta(layer, x):
    out, _ = layer(x)
    layer.disable_adapter_layers()
    base, _ = layer(x)
    layer.enable_adapter_layers()
    return out - base


@pytest.mark.parametrize("position", ["pre", "post"])
def test_dropout_applies_at_its_position_in_training_only(position):
    layer = _layer(dropout=0.5, dropout_position=position)
    randomize_adapters(layer)
    x = torch.randn(6, 2, 32)
    a, b, scale = layer.adapter.linear_in.weight, layer.adapter.linear_out.weight, layer.adapter.scale
    torch.manual_seed(7)
    delta = _adapter_delta(layer, x)
    torch.manual_seed(7)
    mask = torch.nn.functional.dropout(torch.ones(6, 2, 32 if position == "pre" else 128), 0.5)
    expected = scale * ((x * mask) @ a.t() @ b.t() if position == "pre" else (x @ a.t() @ b.t()) * mask)
    torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-6)
    layer.eval()
    torch.testing.assert_close(_adapter_delta(layer, x), scale * x @ a.t() @ b.t(), rtol=1e-5, atol=1e-6)


def test_default_init_is_xavier_a_and_zero_b():
    adapter = _layer().adapter
    assert torch.count_nonzero(adapter.linear_out.weight) == 0
    a = adapter.linear_in.weight
    assert a.std().item() == pytest.approx(math.sqrt(2.0 / (8 + 32)), rel=0.2)


@pytest.mark.parametrize(
    "method, check",
    [
        ("zero", lambda w: torch.count_nonzero(w) == 0),
        ("normal", lambda w: 0.15 < w.std().item() < 0.25),
        ("kaiming", lambda w: w.abs().max().item() <= 1 / math.sqrt(32) + 1e-6),
        ("xavier", lambda w: 0.1 < w.std().item() < 0.35),
    ],
)
def test_init_methods_of_a(method, check):
    assert check(_layer(lora_A_init_method=method).adapter.linear_in.weight.detach())


def test_b_init_method_other_than_zero_changes_the_output():
    layer = _layer(lora_B_init_method="normal")
    assert torch.count_nonzero(layer.adapter.linear_out.weight) > 0
    assert _adapter_delta(layer, torch.randn(3, 1, 32)).abs().max() > 0


def test_lora_dtype_sets_the_adapter_parameters_dtype_only():
    layer = _layer(lora_dtype=torch.float64)
    assert layer.adapter.linear_in.weight.dtype == torch.float64
    assert layer.to_wrap.weight.dtype == torch.float32
    out, _ = layer(torch.randn(3, 1, 32))
    assert out.dtype == torch.float32


def test_adapters_do_not_depend_on_the_global_rng():
    first = _layer().adapter.linear_in.weight.detach().clone()
    torch.manual_seed(99)
    [model] = LoRA(dim=8, alpha=16)([tiny_gpt()])
    assert torch.equal(model.decoder.layers[0].mlp.linear_fc1.adapter.linear_in.weight, first)
    other = model.decoder.layers[1].mlp.linear_fc1.adapter.linear_in.weight
    assert not torch.equal(other, first)


def test_a_pipeline_stage_draws_the_adapters_of_its_global_layers():
    torch.manual_seed(0)
    [full] = LoRA(dim=8)([tiny_gpt(num_layers=2)])
    torch.manual_seed(0)
    stage = tiny_gpt(num_layers=1)
    stage.decoder.layers[0].layer_number = 2  # the second stage of two holds the model's layer 1
    LoRA(dim=8)([stage])
    for name, p in stage.decoder.layers[0].named_parameters():
        if ".adapter." in name:
            assert torch.equal(p, full.decoder.layers[1].get_parameter(name)), name
