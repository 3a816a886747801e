"""Megatron-LM's other optimizer layouts in ``torch_dist``, resumed in megatron_lite with their moments:
the distributed optimizer's state in model space (the ``fully_reshardable`` Megatron-LM writes with
``--dist-ckpt-optim-fully-reshardable``; ``fully_sharded_model_space``, still megatron-core's default,
builds ShardedTensors with a ``flattened_range`` that its 0.16 ShardedTensor refuses, so it is not
written here: its keys are ours), and a MoE model's chained optimizer
(dense and expert parts, megatron-core's ``ChainedOptimizer``), with and without the ``chained_<i>.``
prefix older Megatron-LM gave its tensors, and in its ``torch`` format (a list of the parts' states). And back: our distributed optimizer's checkpoint read by
megatron-core as Megatron-LM's resume with ``--use-distributed-optimizer`` reads it."""

from __future__ import annotations

import copy
import os
import zlib

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_world
from mcore_helpers import mcore_save_on_cpu
from megatron_lm_helpers import (
    TRAIN,
    fp32_optimizer,
    fully_reshardable,
    mcore_llama,
    mcore_mixtral,
    megatron_lm_args,
    megatron_lm_schedule,
    our_resume,
    track_latest,
)

pytestmark = pytest.mark.world  # every test here starts processes

MOE_ARGS = dict(expert_model_parallel_size=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)


def _adam_after_a_step(model, rank, own, params=None):
    """torch's Adam after one step on fixed gradients, over megatron-core's param groups of ``params``
    (all of the model's by default). ``own(name, param)``: a parameter this rank holds a part of its
    own (its gradient differs from the other rank's; a replicated one's is the same)."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    groups = _get_param_groups([model], OptimizerConfig(lr=3e-4, min_lr=3e-5, weight_decay=0.1), None)
    if params is not None:
        groups = [g | {"params": [p for p in g["params"] if id(p) in params]} for g in groups]
        groups = [g for g in groups if g["params"]]
    adam = torch.optim.Adam(groups, lr=3e-4, weight_decay=0.1)
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1000 * rank if own(name, p) else 0))
        p.grad = torch.randn(p.shape, generator=gen)
    adam.step()
    return adam


def _their_run_and_our_resume(rank, world, root, layout):
    """A Megatron-LM ``torch_dist`` checkpoint at iteration 7 whose optimizer state is in ``layout``,
    then megatron_lite resuming it in the same world: each side's moments by parameter name."""
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing
    from megatron.core import parallel_state as mps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from megatron_lite.core import parallel_state

    moe = layout.startswith("chained")
    model = mcore_mixtral() if moe else mcore_llama()
    model_sd = model.sharded_state_dict()
    if moe:  # Megatron-LM's MoE optimizer: the dense parameters' and the experts', chained
        experts = {id(p) for n, p in model.named_parameters() if ".experts." in n}
        dense = {id(p) for p in model.parameters()} - experts
        own = lambda name, _: ".experts." in name  # noqa: E731
        adams = [_adam_after_a_step(model, rank, own, ids) for ids in (dense, experts)]
        chained = ChainedOptimizer([fp32_optimizer(a) for a in adams])
        metadata = {"chained_optim_avoid_prefix": layout == "chained"}
        optimizer_state = chained.sharded_state_dict(model_sd, metadata=metadata)
        args = megatron_lm_args(**MOE_ARGS)
    elif layout == "common_state_object":  # a non-distributed optimizer, as test_megatron_lm_resume's
        adams = [_adam_after_a_step(model, rank, lambda _, p: getattr(p, "tensor_model_parallel", False))]
        optimizer_state = fp32_optimizer(adams[0]).sharded_state_dict(model_sd)
        args = megatron_lm_args(tensor_model_parallel_size=2)
    else:
        adam = _adam_after_a_step(model, rank, lambda _, p: getattr(p, "tensor_model_parallel", False))
        optimizer_state = fully_reshardable(
            model,
            lambda p: {
                "param": p.detach() + 1,  # not the weights: where our run takes its fp32 weights from
                "exp_avg": adam.state[p]["exp_avg"],
                "exp_avg_sq": adam.state[p]["exp_avg_sq"],
            },
        )
        groups = [{k: v for k, v in g.items() if k != "params"} for g in adam.state_dict()["param_groups"]]
        optimizer_state["optimizer"] = {"param_groups": [g | {"step": 1.0} for g in groups]}
        adams = [adam]
        args = megatron_lm_args(tensor_model_parallel_size=2, use_distributed_optimizer=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": model_sd}
    state |= {"optimizer": optimizer_state, "opt_param_scheduler": megatron_lm_schedule()}
    directory = os.path.join(root, "iter_0000007")
    if layout == "chained_torch":  # its torch format: each part's torch state dict, in a list
        shard = os.path.join(directory, f"mp_rank_00_{rank:03d}", "model_optim_rng.pt")
        os.makedirs(os.path.dirname(shard), exist_ok=True)
        torch.save(state | {"model": model.state_dict(), "optimizer": chained.state_dict()}, shard)
    else:
        os.makedirs(directory, exist_ok=True)
        if layout == "common_state_object":  # Megatron-LM's HEAD: the common state inside the DCP files
            _, common = save_preprocess(copy.deepcopy(state), validate_access_integrity=False)
            state["common_state"] = ShardedObject("common_state", common, (1,), (0,), replica_id=rank)
        with mcore_save_on_cpu():
            mcore_dist_checkpointing.save(state, directory)
        dist.barrier()
        if layout == "common_state_object" and rank == 0:
            os.remove(os.path.join(directory, "common.pt"))  # which megatron-core 0.16 still writes
    track_latest(root, 7)
    names = {id(p): n for n, p in model.named_parameters()}
    theirs = {
        names[id(p)]: (s["exp_avg"], s["exp_avg_sq"], float(s["step"]))
        for a in adams
        for p, s in a.state.items()
    }
    saved_keys = (
        () if layout == "chained_torch" else mcore_dist_checkpointing.load_tensors_metadata(directory)
    )
    mps.destroy_model_parallel()
    parallel = (
        ["--expert-model-parallel-size", "2", "--nproc-per-node", "2"]
        if moe
        else ["--tensor-model-parallel-size", "2"]
    )
    distributed = ["--use-distributed-optimizer"] if layout == "fully_reshardable" else []
    setup, ours = our_resume(
        [*TRAIN, "--load", root, *parallel, *distributed, "--use-checkpoint-opt-param-scheduler"]
    )
    parallel_state.destroy_model_parallel()
    common_pt = os.path.exists(os.path.join(directory, "common.pt"))
    weights = {n.removeprefix("module."): p.detach() for n, p in setup.model[0].named_parameters()}
    their_fp32 = (
        {n: p.detach() + 1 for n, p in model.named_parameters()} if layout == "fully_reshardable" else {}
    )
    return dict(
        theirs=theirs,
        ours=ours,
        prefixed=any(k.startswith("chained_1.") for k in saved_keys),
        common_pt=common_pt,
        weights=weights,
        their_fp32=their_fp32,
    )


@pytest.mark.parametrize(
    "layout", ["fully_reshardable", "chained", "chained_prefixed", "chained_torch", "common_state_object"]
)
def test_a_megatron_lm_optimizer_layout_resumes_with_its_moments(tmp_path, layout):
    for rank, r in enumerate(run_world(_their_run_and_our_resume, 2, str(tmp_path / "run"), layout)):
        assert r["prefixed"] == (layout == "chained_prefixed")  # the layout is the one meant
        assert r["common_pt"] == (layout not in ("chained_torch", "common_state_object"))
        assert r["ours"].keys() == r["theirs"].keys(), sorted(r["ours"].keys() ^ r["theirs"].keys())
        for name, (exp_avg, exp_avg_sq, step) in r["theirs"].items():
            ours = r["ours"][name]
            # the distributed optimizer's shard is flat (all of it at dp 1)
            assert torch.equal(ours[0].view(-1), exp_avg.view(-1)), (rank, name)
            assert torch.equal(ours[1].view(-1), exp_avg_sq.view(-1)), (rank, name)
            assert ours[2] == step == 1.0
        for name, fp32 in r["their_fp32"].items():  # an fp32 run's weights are the fp32 main weights
            assert torch.equal(r["weights"][name], fp32), (rank, name)
