"""Upstream's layer specs (spec_utils, gpt_layer_specs) over megatron_lite's modules."""

import pytest
import torch

from megatron_lite.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_local_submodules,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron_lite.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron_lite.core.transformer.moe.moe_layer import MoELayer
from megatron_lite.core.transformer.spec_utils import ModuleSpec, build_module, get_submodules
from megatron_lite.core.transformer.transformer_block import TransformerBlock
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.transformer.transformer_layer import TransformerLayer


def _config(**overrides):
    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=2, add_bias_linear=False)
    return TransformerConfig(**{**fields, **overrides})


def test_build_module_passes_params_and_submodules():
    built = build_module(ModuleSpec(module=dict, params={"a": 1}, submodules="s"), b=2)
    assert built == {"a": 1, "b": 2, "submodules": "s"}


def test_the_default_local_spec_is_a_dense_transformer_layer():
    spec = get_gpt_layer_local_spec()
    assert spec.module is TransformerLayer
    assert get_submodules(spec.submodules.mlp) is not None


def test_a_block_built_from_the_spec_equals_the_one_built_from_the_config():
    config = _config(num_moe_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=8)
    from_spec = TransformerBlock(config, get_gpt_decoder_block_spec(config, False))
    from_config = TransformerBlock(config)
    assert isinstance(from_spec.layers[1].mlp, MoELayer) and not isinstance(from_spec.layers[0].mlp, MoELayer)
    for (name, a), (_, b) in zip(
        from_spec.state_dict().items(), from_config.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("grouped, experts", [(False, SequentialMLP), (True, TEGroupedMLP)])
def test_a_spec_built_moe_layer_answers_upstreams_output_and_bias(grouped, experts):
    config = _config(num_moe_experts=4, moe_ffn_hidden_size=8)
    layer = MoELayer(
        config, get_submodules(get_gpt_layer_local_submodules(num_experts=4, moe_grouped_gemm=grouped).mlp)
    )
    output, bias = layer(torch.randn(4, 2, 16))
    assert isinstance(layer.experts, experts) and output.shape == (4, 2, 16) and bias is None


def test_the_transformer_engine_spec_is_refused_in_one_line():
    with pytest.raises(ValueError, match="Transformer Engine is not available"):
        get_gpt_layer_with_transformer_engine_spec()
