"""megatron-core's own unit tests of the layer split, ported by changing the prefix:
TestPipelineParallelTransformerBlock.test_layer_builder (tests/unit_tests/transformer/
test_transformer_block.py) and TestParallelTransformerLayer.test_get_layer_offset_parametrized
(test_transformer_layer.py), their cases and expectations as upstream. Upstream fakes the pipeline
rank through parallel_state's setters; so do these."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from megatron_lite.core import parallel_state
from megatron_lite.core.transformer.transformer_block import TransformerBlock, get_num_layers_to_build
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.transformer.transformer_layer import get_transformer_layer_offset


@pytest.fixture(autouse=True)
def _no_fake_rank():
    yield
    parallel_state.set_pipeline_model_parallel_rank(None)
    parallel_state.set_pipeline_model_parallel_world_size(None)


@pytest.mark.parametrize(
    "num_layers, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, "
    "account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split, "
    "first_pipeline_num_layers, last_pipeline_num_layers, should_assert_error",
    [
        (60, 5, None, False, False, None, 4, False),
        (60, 8, None, False, False, 6, 6, False),
        (64, 4, None, False, False, None, None, False),
        (64, 4, 8, False, False, None, None, False),
        (60, 6, None, False, False, 5, None, False),
        (101, 8, None, False, False, 13, 13, True),
        (63, 4, None, True, False, None, None, False),
        (63, 4, None, False, True, None, None, False),
        (62, 4, None, True, True, None, None, False),
        (62, 4, 2, True, True, None, None, False),
        (65, 4, None, False, False, None, None, True),
        (65, 4, None, True, True, None, None, True),
        (61, 4, None, False, False, 12, None, True),
        (2, 4, None, False, False, None, None, True),
        (60, 6, None, True, False, 5, 5, True),
        (50, 2, 7, False, False, None, None, True),
        (4, 4, 4, False, False, None, None, True),
    ],
)
def test_layer_builder(
    num_layers,
    pipeline_model_parallel_size,
    virtual_pipeline_model_parallel_size,
    account_for_embedding_in_pipeline_split,
    account_for_loss_in_pipeline_split,
    first_pipeline_num_layers,
    last_pipeline_num_layers,
    should_assert_error,
):
    parallel_state.set_pipeline_model_parallel_world_size(pipeline_model_parallel_size)
    context = pytest.raises((AssertionError, ValueError)) if should_assert_error else nullcontext()
    with context:
        transformer_config = TransformerConfig(
            num_layers=num_layers,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            account_for_embedding_in_pipeline_split=account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split=account_for_loss_in_pipeline_split,
            num_layers_in_first_pipeline_stage=first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage=last_pipeline_num_layers,
            pipeline_dtype=torch.bfloat16,
            hidden_size=128,
            num_attention_heads=16,
        )
        total_build_layers = 0
        for i in range(pipeline_model_parallel_size):
            if virtual_pipeline_model_parallel_size is not None:
                for j in range(virtual_pipeline_model_parallel_size):
                    total_build_layers += get_num_layers_to_build(transformer_config, vp_stage=j, pp_rank=i)
            else:
                total_build_layers += get_num_layers_to_build(transformer_config, pp_rank=i)
    if not should_assert_error:
        assert total_build_layers == num_layers


def _vp2(num_layers, first, last) -> dict:
    return {
        "num_layers": num_layers,
        "pipeline_model_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": 2,
        "num_layers_in_first_pipeline_stage": first,
        "num_layers_in_last_pipeline_stage": last,
        "pipeline_dtype": torch.bfloat16,
    }


@pytest.mark.parametrize(
    "config_params,expected_offsets",
    [
        # 30 layers: 8 + 6 + 6 + 10
        (_vp2(30, 8, 10), {(0, 0): 0, (0, 1): 15, (1, 0): 4, (1, 1): 19, (2, 0): 7, (2, 1): 22, (3, 0): 10, (3, 1): 25}),
        # 26 layers: 8 + 6 + 6 + 6
        (_vp2(26, 8, None), {(0, 0): 0, (0, 1): 13, (1, 0): 4, (1, 1): 17, (2, 0): 7, (2, 1): 20, (3, 0): 10, (3, 1): 23}),
        # 26 layers: 6 + 6 + 6 + 8
        (_vp2(26, None, 8), {(0, 0): 0, (0, 1): 13, (1, 0): 3, (1, 1): 16, (2, 0): 6, (2, 1): 19, (3, 0): 9, (3, 1): 22}),
        # 24 layers: 6 + 6 + 6 + 6
        (_vp2(24, None, None), {(0, 0): 0, (0, 1): 12, (1, 0): 3, (1, 1): 15, (2, 0): 6, (2, 1): 18, (3, 0): 9, (3, 1): 21}),
    ],
)  # fmt: skip
def test_get_layer_offset_parametrized(config_params, expected_offsets):
    config = TransformerConfig(
        hidden_size=512, num_attention_heads=8, use_cpu_initialization=True, **config_params
    )
    for (pipeline_rank, vp_stage), expected_offset in expected_offsets.items():
        parallel_state.set_pipeline_model_parallel_rank(pipeline_rank)
        assert get_transformer_layer_offset(config, vp_stage) == expected_offset, (pipeline_rank, vp_stage)


def test_get_layer_offset():
    parallel_state.set_pipeline_model_parallel_rank(0)
    assert (
        get_transformer_layer_offset(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4))
        == 0
    )


# TestPipelineParallelLayoutTransformerBlock (test_transformer_block.py), its cases as upstream.
@pytest.mark.parametrize(
    "num_layers, pp_size, vpp_size, pipeline_model_parallel_layout, should_assert_error",
    [
        (7, 2, 1, [["decoder"] * 6, ["decoder", "loss"]], True),
        (7, 2, 1, [["embedding"] + ["decoder"] * 6, ["decoder"]], True),
        (7, 2, 1, [["embedding"], ["invalid_type"] * 7 + ["loss"]], True),
        (7, 2, 2, [["embedding"], ["decoder"] * 7, ["loss"]], True),
        (7, 2, 2, [[["embedding", "decoder"], ["decoder"] * 4], ["decoder"], ["decoder", "loss"]], True),
        (7, 2, 1, [[["embedding", "decoder"], ["decoder"] * 4], ["decoder"] * 2 + ["loss"]], True),
        (7, 2, 1, [[["embedding"] + ["decoder"] * 5], ["decoder"] * 2 + ["loss"]], True),
        (7, 2, 2, [[["embedding", "decoder"], ["decoder"] * 3], [["decoder"] * 2, ["decoder", "loss"]]], True),
        (7, 2, 2, [["embedding", "decoder"], ["decoder"] * 4, ["decoder"], ["decoder", "loss"]], False),
        (7, 2, 2, [["embedding"], ["decoder"] * 7, [], ["loss"]], False),
        (7, 2, 2, [["embedding"], ["decoder"] * 6, ["decoder"], ["loss"]], False),
    ],
)  # fmt: skip
def test_layout_layer_builder(
    num_layers, pp_size, vpp_size, pipeline_model_parallel_layout, should_assert_error
):
    parallel_state.set_pipeline_model_parallel_world_size(pp_size)
    context = pytest.raises((AssertionError, ValueError)) if should_assert_error else nullcontext()
    with context:
        transformer_config = TransformerConfig(
            num_layers=num_layers,
            pipeline_model_parallel_layout=pipeline_model_parallel_layout,
            pipeline_model_parallel_size=pp_size,
            pipeline_dtype=torch.bfloat16,
            hidden_size=128,
            num_attention_heads=16,
        )
        total_build_layers = 0
        for i in range(pp_size):
            parallel_state.set_pipeline_model_parallel_rank(i)
            for j in range(vpp_size):
                total_build_layers += get_num_layers_to_build(transformer_config, vp_stage=j)
    if not should_assert_error:
        assert total_build_layers == num_layers


def test_layout_layer_number():
    """test_layout_layer_number's case: each chunk's layers carry upstream's global layer numbers
    (built here as TransformerBlocks, upstream builds GPTModels)."""
    layout = [
        ["embedding"],
        ["decoder"],
        ["decoder"] * 2,
        ["decoder"],
        [],
        ["decoder"],
        ["decoder"],
        ["decoder"] * 2 + ["loss"],
    ]
    golden = [[[], []], [[1], [5]], [[2, 3], [6]], [[4], [7, 8]]]
    config = TransformerConfig(
        num_layers=8, hidden_size=8, num_attention_heads=8, pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_layout=layout,
    )  # fmt: skip
    for pp_rank in range(4):
        for vp_stage in range(2):
            block = TransformerBlock(config, pp_rank=pp_rank, vp_stage=vp_stage, post_process=False)
            assert [layer.layer_number for layer in block.layers] == golden[pp_rank][vp_stage]
