"""LoRA on a GPT model at one process (megatron_lite.peft, Megatron-Bridge's semantics): what it wraps,
what it freezes, the keys it adds, and that each wrapped layer computes W x + alpha / dim * B A x."""

from __future__ import annotations

import pytest
import torch
from lora_case_helpers import lora_by_hand, randomize_adapters, tiny_gpt, tokens_and_positions

from megatron_lite.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.peft import PEFT, AdapterWrapper, LoRA, LoRALinear, ParallelLinearAdapter
from megatron_lite.peft.utils import is_adapter_key

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _lora_model(**lora_fields):
    torch.manual_seed(0)
    model = tiny_gpt()
    return model, LoRA(dim=8, alpha=16, **lora_fields)([model])[0]


def test_every_default_target_is_wrapped_in_a_lora_linear_around_its_base_layer():
    _, model = _lora_model()
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert sorted({n.rsplit(".", 1)[1] for n in wrapped}) == sorted(TARGETS)
    assert len(wrapped) == 2 * len(TARGETS)
    for name, module in wrapped.items():
        assert isinstance(module, AdapterWrapper) and isinstance(module.adapter, ParallelLinearAdapter)
        column = name.endswith(("linear_qkv", "linear_fc1"))
        assert isinstance(module.to_wrap, ColumnParallelLinear if column else RowParallelLinear)


def test_only_adapter_parameters_are_trainable():
    _, model = _lora_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert trainable and all(".adapter.linear_in." in n or ".adapter.linear_out." in n for n in trainable)
    assert "decoder.layers.0.self_attention.linear_qkv.to_wrap.weight" in frozen
    assert "embedding.word_embeddings.weight" in frozen
    assert model.training


def test_state_dict_keeps_the_base_keys_and_adds_adapter_keys():
    torch.manual_seed(0)
    base_keys = set(tiny_gpt().state_dict())
    _, model = _lora_model()
    keys = set(model.state_dict())
    assert base_keys <= keys
    added = keys - base_keys
    assert "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight" in added
    assert "decoder.layers.1.mlp.linear_fc2.adapter.linear_out.weight" in added
    assert all(is_adapter_key(k) for k in added) and not any(is_adapter_key(k) for k in base_keys)


def test_sharded_state_dict_keeps_the_base_keys_and_adds_adapter_keys():
    _, model = _lora_model()
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    sharded = qkv.sharded_state_dict("decoder.layers.0.self_attention.linear_qkv.")
    assert sorted(sharded) == [
        "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight",
        "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight",
        "decoder.layers.0.self_attention.linear_qkv.bias",
        "decoder.layers.0.self_attention.linear_qkv.weight",
    ]
    assert sharded["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"].global_shape == (
        8,
        32,
    )
    model_keys = set(model.sharded_state_dict())
    assert set(model.state_dict()) <= model_keys | {k for k in model.state_dict() if "_extra_state" in k}


def test_a_base_checkpoint_loads_into_the_lora_model_leaving_only_adapters_missing():
    torch.manual_seed(1)
    base = tiny_gpt()
    _, model = _lora_model()
    result = model.load_state_dict(base.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys and all(is_adapter_key(k) for k in result.missing_keys)
    for key, value in base.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_zero_initialised_b_leaves_the_model_output_exactly_the_base_output():
    base, _ = None, None
    torch.manual_seed(0)
    base = tiny_gpt()
    tokens, positions = tokens_and_positions()
    expected = base(tokens, positions)
    [model] = LoRA(dim=8, alpha=16)([base])
    assert torch.equal(model(tokens, positions), expected)


@pytest.mark.parametrize("target", TARGETS)
def test_wrapped_layer_computes_base_plus_scaled_b_a_x(target):
    _, model = _lora_model()
    randomize_adapters(model)
    layer = dict(model.named_modules())[
        f"decoder.layers.1.{'self_attention' if 'qkv' in target or 'proj' in target else 'mlp'}.{target}"
    ]
    x = torch.randn(5, 3, layer.to_wrap.input_size, generator=torch.Generator().manual_seed(2))
    out, bias = layer(x)
    torch.testing.assert_close(
        out if bias is None else out + bias, lora_by_hand(x, layer), rtol=1e-5, atol=1e-6
    )
    assert layer.adapter.scale == 2.0


def test_disabled_adapters_give_the_base_output_and_enabling_restores_lora():
    peft = LoRA(dim=8, alpha=16)
    torch.manual_seed(0)
    model = tiny_gpt()
    tokens, positions = tokens_and_positions()
    base_out = model(tokens, positions)
    peft([model])
    randomize_adapters(model)
    lora_out = model(tokens, positions)
    assert not torch.allclose(lora_out, base_out)
    with peft.disable_adapter([model]):
        assert torch.equal(model(tokens, positions), base_out)
    assert torch.equal(model(tokens, positions), lora_out)


def test_adapter_gradients_flow_and_base_gradients_do_not():
    _, model = _lora_model()
    randomize_adapters(model)
    tokens, positions = tokens_and_positions()
    model(tokens, positions).float().mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == p.requires_grad, name


def test_peft_call_on_one_module_and_eval_mode():
    torch.manual_seed(0)
    model = tiny_gpt()
    out = LoRA(dim=4)(model, training=False)
    assert out is model and not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_params_to_save_and_adapter_key_filter_select_the_adapters():
    peft = LoRA(dim=4)
    torch.manual_seed(0)
    model = peft(tiny_gpt())
    peft.set_params_to_save(model)
    assert peft.params_to_save == {n for n, p in model.named_parameters() if p.requires_grad}
    keys = model.state_dict()
    assert {k for k in keys if peft.adapter_key_filter(k)} == {k for k in keys if is_adapter_key(k)}
    weight = model.decoder.layers[0].self_attention.linear_qkv.to_wrap.weight
    assert not peft.adapter_key_filter(("k", weight))
    assert isinstance(peft, PEFT)


@pytest.mark.parametrize("second", [dict(), dict(target_modules=["*linear*"]), dict(target_modules=[])])
def test_applying_lora_twice_wraps_nothing_twice(second):
    _, model = _lora_model()
    wrapped = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    LoRA(dim=8, **second)([model])
    again = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert wrapped <= again and not any(".adapter." in n or n.endswith(".to_wrap") for n in again)


def test_adapter_shapes_and_tensor_parallel_attributes_at_one_process():
    _, model = _lora_model()
    qkv = model.decoder.layers[0].self_attention.linear_qkv.adapter
    proj = model.decoder.layers[0].self_attention.linear_proj.adapter
    assert tuple(qkv.linear_in.weight.shape) == (8, 32) and tuple(qkv.linear_out.weight.shape) == (96, 8)
    assert tuple(proj.linear_in.weight.shape) == (8, 32) and tuple(proj.linear_out.weight.shape) == (32, 8)
    assert isinstance(qkv.linear_in, ColumnParallelLinear) and isinstance(proj.linear_in, RowParallelLinear)
    for p in (qkv.linear_in.weight, qkv.linear_out.weight, proj.linear_out.weight):
        assert p.tensor_model_parallel and p.partition_dim == 0 and p.partition_stride == 1 and p.allreduce
    assert proj.linear_in.weight.partition_dim == 1


def test_wrapper_reads_the_base_layers_attributes():
    _, model = _lora_model()
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert qkv.config is qkv.to_wrap.config and qkv.input_size == 32
    assert qkv.bias is qkv.to_wrap.bias


def test_a_lora_state_dict_loads_strictly_into_another_lora_model():
    _, source = _lora_model()
    randomize_adapters(source, seed=5)
    torch.manual_seed(1)
    [target] = LoRA(dim=8, alpha=16)([tiny_gpt()])
    result = target.load_state_dict(source.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
