"""Back to Megatron-LM with the optimizer's state: our distributed optimizer's checkpoint and a MoE
model's, read by megatron-core as Megatron-LM's resume reads them (``--use-distributed-optimizer``: its
``fully_reshardable`` request; a MoE model: its chained optimizer of the dense and the expert parts)."""

from __future__ import annotations

import os

import pytest
import torch
from dist_helpers import run_pretrain, run_world
from mcore_helpers import poison
from megatron_lm_helpers import (
    LLAMA_FLAGS,
    TRAIN,
    fp32_optimizer,
    fully_reshardable,
    mcore_llama,
    mcore_mixtral,
    our_resume,
)

pytestmark = pytest.mark.world  # every test here starts processes


def _our_mains(setup) -> dict:
    """Our optimizer's fp32 main parameters by name, each a flat tensor (the distributed optimizer's
    shards of a parameter in order: all of it at dp 1)."""
    names = {id(p): n.removeprefix("module.") for n, p in setup.model[0].named_parameters()}
    parts: dict = {}
    for unit in sorted(setup.optimizer.units, key=lambda u: u.start):
        parts.setdefault(names[id(unit.param)], []).append(unit.main.detach().view(-1))
    return {name: torch.cat(flat) for name, flat in parts.items()}


def _megatron_core_reads_our_distributed_optimizer(rank, world, root, precision):
    """Megatron-LM's resume with ``--use-distributed-optimizer`` of our checkpoint, with megatron-core's
    code where it runs without CUDA: the content metadata it lays its request out by, the load of
    that request (the model and ``fully_reshardable``'s tensors), whether each of its runtime param
    groups (``_get_param_groups``) finds its saved group by megatron-core's identifier keys, as
    ``DistributedOptimizer.load_state_dict`` looks them up; beside our own resume of the same checkpoint."""
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing
    from megatron.core import parallel_state as mps
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    from megatron_lite.core import parallel_state

    llama = mcore_llama()
    poison(llama)
    directory = os.path.join(root, "iter_0000003")
    content = mcore_dist_checkpointing.load_content_metadata(directory)
    names = ("param", "exp_avg", "exp_avg_sq")
    request = {"model": llama.sharded_state_dict()}
    request["optimizer"] = fully_reshardable(llama, lambda p: {k: torch.empty_like(p) for k in names})
    loaded = mcore_dist_checkpointing.load(request, directory, strict=StrictHandling.LOG_ALL)
    params = [n for n, _ in llama.named_parameters() if n in request["model"]]
    state = loaded["optimizer"]["param_state"]
    theirs = {name: {k: state[i][k] for k in names} for i, name in enumerate(params)}
    common = {k: v for k, v in loaded["optimizer"].items() if k != "param_state"}
    saved = {tuple(g[k] for k in param_group_identifier_keys) for g in common["optimizer"]["param_groups"]}
    runtime = _get_param_groups([llama], OptimizerConfig(lr=1e-3, weight_decay=0.01), None)
    unmatched = [g for g in runtime if tuple(g[k] for k in param_group_identifier_keys) not in saved]
    mps.destroy_model_parallel()
    argv = [*LLAMA_FLAGS, *TRAIN[:-3], "--load", root, "--use-distributed-optimizer", "--train-iters", "4"]
    argv += ["--bf16"] if precision == "bf16" else []
    setup, ours = our_resume([*argv, "--use-checkpoint-opt-param-scheduler"])
    mains = _our_mains(setup)
    parallel_state.destroy_model_parallel()
    return dict(content=content, common=common, unmatched=unmatched, theirs=theirs, ours=ours, mains=mains)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_megatron_lm_resumes_our_distributed_optimizer_state(tmp_path, precision):
    """bf16: the fp32 main weights Megatron-LM reads are ours, not the bf16 weights."""
    run = [*LLAMA_FLAGS, *TRAIN[:-3], "--train-iters", "3", "--lr", "1e-3", "--use-distributed-optimizer"]
    run += ["--save", "ours", "--ckpt-format", "torch_dist", "--save-interval", "3", "--nproc-per-node", "2"]
    run += ["--bf16"] if precision == "bf16" else []
    result = run_pretrain(run, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for r in run_world(_megatron_core_reads_our_distributed_optimizer, 2, str(tmp_path / "ours"), precision):
        assert r["content"]["distrib_optim_sharding_type"] == "fully_reshardable"
        assert r["content"]["chained_optim_avoid_prefix"] is True
        assert r["common"]["param_state_sharding_type"] == "fully_reshardable"
        assert r["unmatched"] == []
        assert {g["step"] for g in r["common"]["optimizer"]["param_groups"]} == {3}
        assert r["theirs"].keys() == r["ours"].keys() == r["mains"].keys()
        for name, t in r["theirs"].items():
            exp_avg, exp_avg_sq, step = r["ours"][name]
            assert torch.equal(t["exp_avg"].view(-1), exp_avg.view(-1)), name
            assert torch.equal(t["exp_avg_sq"].view(-1), exp_avg_sq.view(-1)), name
            assert torch.equal(t["param"].view(-1), r["mains"][name]) and step == 3.0, name


MIXTRAL_FLAGS = [*LLAMA_FLAGS[: LLAMA_FLAGS.index("--tensor-model-parallel-size")], "--nproc-per-node", "2"]
MIXTRAL_FLAGS += (
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --expert-model-parallel-size 2".split()
)


def _megatron_core_reads_our_moe_optimizer(rank, world, root):
    """Megatron-LM's resume of our Mixtral-shaped checkpoint with its MoE optimizer, megatron-core's
    ChainedOptimizer of two FP32Optimizers (the dense parameters', the experts', each over
    ``_get_param_groups``): its request laid out by the checkpoint's content metadata, the load, its
    ``load_state_dict``; beside our own resume of the same checkpoint."""
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing
    from megatron.core import parallel_state as mps
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from megatron_lite.core import parallel_state

    mixtral = mcore_mixtral()
    poison(mixtral)
    groups = _get_param_groups([mixtral], OptimizerConfig(lr=1e-3, weight_decay=0.01), None)
    parts = [[g for g in groups if g["is_expert_parallel"] == expert] for expert in (False, True)]
    adams = [torch.optim.Adam(part, lr=1e-3, weight_decay=0.01) for part in parts]
    chained = ChainedOptimizer([fp32_optimizer(adam) for adam in adams])
    directory = os.path.join(root, "iter_0000003")
    metadata = mcore_dist_checkpointing.load_content_metadata(directory)
    model_sd = mixtral.sharded_state_dict()
    request = {"model": model_sd, "optimizer": chained.sharded_state_dict(model_sd, True, metadata=metadata)}
    loaded = mcore_dist_checkpointing.load(request, directory, strict=StrictHandling.LOG_ALL)
    chained.load_state_dict(loaded["optimizer"])
    names = {id(p): n for n, p in mixtral.named_parameters()}
    theirs = {
        names[id(p)]: (s["exp_avg"], s["exp_avg_sq"], float(s["step"]))
        for a in adams
        for p, s in a.state.items()
    }
    mps.destroy_model_parallel()
    argv = [*MIXTRAL_FLAGS, *TRAIN[:-3], "--load", root, "--train-iters", "4"]
    _, ours = our_resume([*argv, "--use-checkpoint-opt-param-scheduler"])
    parallel_state.destroy_model_parallel()
    return theirs, ours


def test_megatron_lm_resumes_our_moe_optimizer_state(tmp_path):
    run = [*MIXTRAL_FLAGS, *TRAIN[:-3], "--train-iters", "3", "--lr", "1e-3"]
    run += ["--save", "ours", "--ckpt-format", "torch_dist", "--save-interval", "3"]
    result = run_pretrain(run, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for theirs, ours in run_world(_megatron_core_reads_our_moe_optimizer, 2, str(tmp_path / "ours")):
        assert theirs.keys() == ours.keys() and any(".experts." in name for name in ours)
        for name, (exp_avg, exp_avg_sq, step) in ours.items():
            assert torch.equal(theirs[name][0], exp_avg) and torch.equal(theirs[name][1], exp_avg_sq), name
            assert theirs[name][2] == step == 3.0, name
