"""A Megatron-LM ``torch_dist`` common state's optimizer part (checkpointing/megatron_lm_optimizer.common):
which layouts are read, under which names, and the one line for those that are not."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.core.dist_checkpointing.mapping import ShardedTensor
from megatron_lite.training.checkpointing.megatron_lm_optimizer import chained_keys, common

GROUPS = [
    {"lr": 3e-4, "weight_decay": 0.1, "wd_mult": 1.0, "step": 5},
    {"lr": 3e-4, "wd_mult": 0.0, "step": 5},
]


def _distributed(sharding: str) -> dict:
    """DistributedOptimizer.sharded_state_dict's common part: torch's groups without parameters."""
    return {"optimizer": {"param_groups": [dict(g) for g in GROUPS]}, "param_state_sharding_type": sharding}


@pytest.mark.parametrize(
    "sharding, prefix",
    [
        ("fully_sharded_model_space", "optimizer.state.fp32_param."),
        ("fully_reshardable", "optimizer.state.param."),
    ],
)
def test_the_distributed_optimizers_model_space_is_read(sharding, prefix):
    state, why = common(_distributed(sharding))
    assert why is None and state["step"] == 5.0 and state["use_distributed_optimizer"]
    assert state["fp32_param"] and state["fp32_param_prefix"] == prefix
    assert [g["wd_mult"] for g in state["param_groups"]] == [1.0, 0.0]


@pytest.mark.parametrize(
    "sharding", ["dp_reshardable", "dp_zero_gather_scatter", "fully_sharded_bucket_space"]
)
def test_a_bucket_space_layout_is_refused_naming_megatron_lms_flag(sharding):
    state, why = common(_distributed(sharding))
    assert state is None
    assert f"Megatron-LM's {sharding!r} format" in why and "--dist-ckpt-optim-fully-reshardable" in why


def test_a_chained_optimizer_is_its_parts_together():
    dense = {"param_groups": [dict(GROUPS[0])], "state": {"common_step": 5}}
    experts = {"param_groups": [dict(GROUPS[1])], "state": {"common_step": 5}}
    state, why = common({0: dense, 1: experts})
    assert why is None and state["step"] == 5.0 and not state["fp32_param"]
    assert [g["wd_mult"] for g in state["param_groups"]] == [1.0, 0.0]
    state, why = common({0: dense, 1: _distributed("dp_reshardable")})
    assert state is None and "'dp_reshardable'" in why
    state, why = common({0: dense, 1: _distributed("fully_reshardable")})
    assert state is None and "differently" in why


def test_older_chained_prefixes_are_read_where_the_plain_key_is_missing():
    def piece(key):
        return ShardedTensor.from_rank_offsets(key, torch.zeros(2))

    pieces = [
        piece("decoder.w"),
        piece("optimizer.state.exp_avg.decoder.w"),
        piece("optimizer.state.exp_avg.x"),
    ]
    chained_keys(
        pieces, {"decoder.w", "chained_1.optimizer.state.exp_avg.decoder.w", "optimizer.state.exp_avg.x"}
    )
    assert [p.key for p in pieces] == [
        "decoder.w",
        "chained_1.optimizer.state.exp_avg.decoder.w",
        "optimizer.state.exp_avg.x",
    ]
