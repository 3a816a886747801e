"""Megatron-LM's non-distributed optimizer state read by parameter name (checkpointing/megatron_lm_optimizer.py),
against megatron-core's own param groups (``_get_param_groups``, which gathers the groups' keys over the
world: a one-rank gloo world here)."""

from __future__ import annotations

import io

import pytest
import torch
from dist_helpers import run_world

from megatron_lite.training.checkpointing.megatron_lm_optimizer import by_name, common


def _later_stage() -> torch.nn.Module:
    """A pipeline stage after the first: its first parameter is a layer norm's (1-D, no weight decay)."""
    stage, layer = torch.nn.Module(), torch.nn.Module()
    stage.decoder = torch.nn.Module()
    stage.decoder.layers = torch.nn.ModuleList([layer])
    layer.input_layernorm = torch.nn.LayerNorm(4)
    layer.self_attention = torch.nn.Module()
    layer.self_attention.linear_qkv = torch.nn.Linear(4, 12)
    layer.mlp = torch.nn.Module()
    layer.mlp.linear_fc1 = torch.nn.Linear(4, 8, bias=False)
    stage.output_layer = torch.nn.Linear(4, 10, bias=False)
    return stage


pytestmark = pytest.mark.world  # megatron-core's grouping runs a collective


def _megatron_core_run(rank, world) -> bytes:
    """Torch's Adam after two steps over megatron-core's own param groups of ``_later_stage()``: the
    stage's and the optimizer's state dicts, and each parameter's moments by name (the truth), as
    bytes (tensors out of a finished process)."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    stage = _later_stage()
    groups = _get_param_groups([stage], OptimizerConfig(lr=1e-3, weight_decay=0.1), None)
    adam = torch.optim.Adam(groups, lr=1e-3, weight_decay=0.1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in stage.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        adam.step()
    truth = {n: (adam.state[p]["exp_avg"], adam.state[p]["exp_avg_sq"]) for n, p in stage.named_parameters()}
    out = io.BytesIO()
    torch.save({"model": stage.state_dict(), "optimizer": adam.state_dict(), "truth": truth}, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def run() -> bytes:
    return run_world(_megatron_core_run, 1)[0]


def _saved(run: bytes) -> dict:
    return torch.load(io.BytesIO(run), weights_only=False)  # a fresh copy for each test


def test_the_state_comes_back_by_name_in_megatron_cores_numbering(run):
    saved = _saved(run)
    assert saved["optimizer"]["param_groups"][0]["wd_mult"] == 1.0  # the weight-decayed group first
    out, reason = by_name(saved["optimizer"], saved["model"])
    assert reason is None and out["step"] == 2.0
    for name, (exp_avg, exp_avg_sq) in saved["truth"].items():
        assert torch.equal(out["state"][name]["exp_avg"], exp_avg), name
        assert torch.equal(out["state"][name]["exp_avg_sq"], exp_avg_sq), name
    assert {g["wd_mult"] for g in out["param_groups"]} == {0.0, 1.0}


def test_fused_adams_step_is_read_from_its_param_groups(run):
    """Transformer Engine's and Apex's FusedAdam keep the step per group, not per parameter."""
    saved = _saved(run)
    state = saved["optimizer"]
    for per_param in state["state"].values():
        del per_param["step"]
    for group in state["param_groups"]:
        group["step"] = 2
    out, _ = by_name(state, saved["model"])
    assert out["step"] == 2.0
    mine, _ = common({"param_groups": state["param_groups"], "state": {}})
    assert mine["step"] == 2.0 and not mine["fp32_param"]


@pytest.mark.parametrize(
    "change, reason",
    [
        (
            lambda s: s["param_groups"][0]["params"].pop(),
            "its param groups hold [2, 3] parameters, not megatron-core's grouping of this model's [3, 3]",
        ),
        (lambda s: s.update(state=None), "it holds no optimizer state of its own"),
        (lambda s: s["param_groups"][1].update(params=None), "an unexpected shape (TypeError)"),
    ],
)
def test_a_state_that_does_not_fit_is_refused_with_the_reason(run, change, reason):
    saved = _saved(run)
    change(saved["optimizer"])
    out, why = by_name(saved["optimizer"], saved["model"])
    assert out is None and reason in why, why
