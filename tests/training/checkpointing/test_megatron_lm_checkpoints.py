"""Megatron-LM's own checkpoints in: what Megatron-LM's ``save_checkpoint`` writes, built here with
megatron-core (the dev extra's oracle) as Megatron-LM's ``generate_state_dict`` lays it out (``args``
as an ``argparse.Namespace`` holding megatron-core's enums and a path, ``checkpoint_version`` 3.0,
``iteration``, the model, optimizer, schedule and RNG states), in both formats:

- ``torch``: a Llama-shaped model at tp 2 (``iter_0000007/mp_rank_0T/model_optim_rng.pt``, no
  ``metadata.json``), with Transformer Engine's names for the fused norms and ``_extra_state`` entries,
  as a GPU run writes them;
- ``torch_dist``: a Mixtral-shaped model at ep 2 (megatron-core's ``dist_checkpointing.save``), and the
  same model in the ``torch`` format (``mp_rank_00_<ep>``).

``pretrain.py --pretrained-checkpoint CKPT --use-checkpoint-args`` at tp 2 x pp 2 (ep 2 x pp 2; ep 2
for the torch-format Mixtral, which loads at its saved layout) takes the architecture from ``args``,
trains one step at learning rate 0 and saves ``torch_dist``, which megatron-core reads back: every
tensor must equal the original bitwise.
"""

from __future__ import annotations

import os
import pickle
import traceback

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_pretrain, run_world
from mcore_helpers import assert_same, mcore_save_on_cpu, poison, tensors
from megatron_lm_helpers import (
    FINETUNE,
    TRAIN,
    VOCAB,
    mcore_llama,
    mcore_mixtral,
    megatron_lm_args,
    megatron_lm_rng_state,
    megatron_lm_schedule,
    te_state_dict,
)

pytestmark = pytest.mark.world  # every test here starts processes


def _write_megatron_lm_checkpoints(rank, world, legacy_root, dist_root, moe_legacy_root):
    """Both of Megatron-LM's formats, as its save_checkpoint writes them; the Mixtral-shaped model in
    both (``mp_rank_00_<ep>``: tp 0 without pipeline stages, each expert-parallel rank its experts)."""
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing

    llama = mcore_llama()
    shard = os.path.join(legacy_root, "iter_0000007", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(shard), exist_ok=True)
    fp32_params = [[p.detach().clone() for p in llama.parameters()]]
    torch.save(
        {
            "args": megatron_lm_args(tensor_model_parallel_size=2),
            "checkpoint_version": 3.0,
            "iteration": 7,
            "model": te_state_dict(llama),
            "optimizer": {
                "optimizer": {"state": {}, "param_groups": []},
                "fp32_from_fp16_params": fp32_params,
            },
            "opt_param_scheduler": megatron_lm_schedule(),
            "rng_state": megatron_lm_rng_state(),
            "num_floating_point_operations_so_far": 1.5e9,
        },
        shard,
    )
    mixtral = mcore_mixtral()
    state = {
        "args": megatron_lm_args(
            expert_model_parallel_size=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32
        )
    }
    state |= {"checkpoint_version": 3.0, "iteration": 9, "num_floating_point_operations_so_far": 2.5e9}
    state |= {"opt_param_scheduler": megatron_lm_schedule(), "model": mixtral.sharded_state_dict()}
    os.makedirs(os.path.join(dist_root, "iter_0000009"), exist_ok=True)
    with mcore_save_on_cpu():
        mcore_dist_checkpointing.save(state, os.path.join(dist_root, "iter_0000009"))
    shard = os.path.join(moe_legacy_root, "iter_0000009", f"mp_rank_00_{rank:03d}", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(shard), exist_ok=True)
    torch.save(state | {"model": mixtral.state_dict()}, shard)
    if rank == 0:
        for root, iteration in ((legacy_root, 7), (dist_root, 9), (moe_legacy_root, 9)):
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
    dist.barrier()


def _read_back_with_megatron_core(rank, world, outputs: dict):
    """Each rank's tensors of our torch_dist saves (``outputs``: model -> directory), read by
    megatron-core, against the originals."""
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    results = {}
    builders = {"llama": mcore_llama, "mixtral": mcore_mixtral}
    for name, root in outputs.items():
        build = builders[name.split("_")[0]]
        try:
            original = tensors(build())
            model = build()
            poison(model)
            loaded, missing, _ = mcore_dist_checkpointing.load(
                model.sharded_state_dict(),
                os.path.join(root, "iter_0000001"),
                strict=StrictHandling.RETURN_ALL,
            )
            # "missing": in the checkpoint, not asked for: only the optimizer's state may be.
            assert all(key.startswith("optimizer.") for key in missing), sorted(missing)
            model.load_state_dict({k: v for k, v in loaded.items() if k in model.state_dict()}, strict=False)
            assert_same(tensors(model), original)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def megatron_lm_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lm")
    legacy, distributed = root / "llama_torch", root / "mixtral_torch_dist"
    run_world(_write_megatron_lm_checkpoints, 2, str(legacy), str(distributed), str(root / "mixtral_torch"))
    return root, legacy, distributed


def test_megatron_lm_checkpoints_load_at_another_layout_and_go_out_bitwise(megatron_lm_checkpoints):
    root, legacy, distributed = megatron_lm_checkpoints
    llama = run_pretrain(
        [*FINETUNE, "--pretrained-checkpoint", str(legacy), "--save", "llama_out"]
        + "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --nproc-per-node 4".split(),
        root,
    )
    assert llama.returncode == 0, llama.stderr[-3000:]
    assert "resharding checkpoint weights from tp=2 pp=1 to tp=2 pp=2" in llama.stdout
    mixtral = run_pretrain(
        [*FINETUNE, "--pretrained-checkpoint", str(distributed), "--save", "mixtral_out"]
        + "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --nproc-per-node 4".split(),
        root,
    )
    assert mixtral.returncode == 0, mixtral.stderr[-3000:]
    # The Mixtral-shaped model in the torch format: at its saved layout (the format holds each
    # expert-parallel rank's experts by local index, as ours).
    mixtral_torch = run_pretrain(
        [*FINETUNE, "--pretrained-checkpoint", str(root / "mixtral_torch"), "--save", "mixtral_torch_out"]
        + "--expert-model-parallel-size 2 --nproc-per-node 2".split(),
        root,
    )
    assert mixtral_torch.returncode == 0, mixtral_torch.stderr[-3000:]
    for result in (llama, mixtral, mixtral_torch):
        assert "finetuning from the pretrained checkpoint" in result.stdout
    outputs = {name: str(root / f"{name}_out") for name in ("llama", "mixtral", "mixtral_torch")}
    results = run_world(_read_back_with_megatron_core, 2, outputs)
    for rank, per_model in enumerate(results):
        for name, outcome in per_model.items():
            assert outcome == "ok", f"rank {rank}, {name}:\n{outcome}"


def test_use_checkpoint_args_reads_megatron_lms_args(megatron_lm_checkpoints):
    from megatron_lite.training.arguments import parse_args

    _, legacy, distributed = megatron_lm_checkpoints
    for ckpt, experts in ((legacy, None), (distributed, 4)):
        m = parse_args(
            ["--use-checkpoint-args", "--pretrained-checkpoint", str(ckpt), "--seq-length", "16"]
        ).model
        assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_query_groups) == (2, 64, 96, 4)
        assert (m.normalization, m.layernorm_epsilon, m.gated_linear_unit) == ("RMSNorm", 1e-6, True)
        assert m.activation_func.__name__ == "silu" and not m.share_embeddings_and_output_weights
        assert (m.vocab_size, m.position_embedding_type, m.add_bias_linear) == (VOCAB, "rope", False)
        assert (
            m.num_moe_experts == experts and m.tensor_model_parallel_size == 1
        )  # the layout stays the run's


def _refused_optimizer_state(resume: list[str], root, checkpoint) -> str:
    """The full resume ``resume`` of ``checkpoint`` stops with one line about its optimizer state: that line."""
    result = run_pretrain(resume, root)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"--load {checkpoint}: a Megatron-LM checkpoint whose optimizer state" in line
    return line


def test_an_optimizer_state_that_does_not_fit_is_one_line_and_no_load_optim_resumes_the_rest(
    megatron_lm_checkpoints,
):
    root, legacy, _ = megatron_lm_checkpoints
    resume = [*TRAIN, "--load", str(legacy), "--tensor-model-parallel-size", "2", "--nproc-per-node", "2"]
    resume[resume.index("--train-iters") + 1] = "8"
    # The saved run consumed 112 samples by iteration 7: this one's 16 (8 x 2) are used up.
    result = run_pretrain([*resume, "--no-load-optim"], root)
    (line,) = result.stderr.strip().splitlines()
    assert "--train-iters 8: the checkpoint's run consumed 112 training samples, all of the 16" in line, line
    resume[resume.index("--global-batch-size") + 1] = "16"
    line = _refused_optimizer_state(resume, root, legacy)
    # The fixture's optimizer state numbers no parameter: it cannot be matched to megatron-core's groups.
    assert "(its param groups hold [] parameters, not megatron-core's grouping" in line
    assert "--no-load-optim resumes the rest" in line
    result = run_pretrain([*resume, "--no-load-optim"], root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "random generator states are Megatron-LM's" in result.stdout
    assert " iteration        8/       8 | consumed samples:          128 |" in result.stdout  # 112 + 16


def test_a_torch_dist_checkpoint_without_optimizer_state_is_one_line_on_a_full_resume(
    megatron_lm_checkpoints,
):
    root, _, distributed = megatron_lm_checkpoints
    resume = [
        *TRAIN,
        "--load",
        str(distributed),
        "--expert-model-parallel-size",
        "2",
        "--nproc-per-node",
        "2",
    ]
    resume[resume.index("--train-iters") + 1] = "10"
    line = _refused_optimizer_state(resume, root, distributed)
    assert "(it holds no optimizer state); --no-load-optim resumes the rest" in line


class _Planted:
    """Unpickling this runs ``os.system``: what a malicious checkpoint file would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("where", ["model_optim_rng.pt", "common.pt", ".metadata"])
def test_a_planted_payload_in_a_megatron_lm_checkpoint_never_runs(megatron_lm_checkpoints, tmp_path, where):
    import shutil

    root, legacy, distributed = megatron_lm_checkpoints
    source = legacy if where == "model_optim_rng.pt" else distributed
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    marker = tmp_path / "ran"
    (path,) = [p for p in ckpt.rglob(where)][:1]
    if where == ".metadata":
        path.write_bytes(pickle.dumps(_Planted(marker)))
    else:
        payload = torch.load(path, weights_only=False)
        payload["args"].planted = _Planted(marker)
        torch.save(payload, path)
    layout = (
        "--tensor-model-parallel-size 2"
        if source is legacy
        else "--expert-model-parallel-size 2 --nproc-per-node 2"
    )
    result = run_pretrain([*TRAIN, "--pretrained-checkpoint", str(ckpt), *layout.split()], root)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not marker.exists()
    (line,) = result.stderr.strip().splitlines()
    assert "posix.system" in line and ("nothing in it was run" in line or "is not allowed" in line), line


@pytest.mark.parametrize("damage", ["cut", "missing"])
def test_a_damaged_distcp_is_one_line_naming_it_and_nothing_is_written(
    megatron_lm_checkpoints, tmp_path, damage
):
    import shutil

    root, _, distributed = megatron_lm_checkpoints
    ckpt = tmp_path / "ckpt"
    shutil.copytree(distributed, ckpt)
    shard = sorted(ckpt.rglob("*.distcp"))[0]
    if damage == "cut":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        shard.unlink()
    out = tmp_path / "out"
    args = [*FINETUNE, "--pretrained-checkpoint", str(ckpt), "--save", str(out)]
    result = run_pretrain([*args, "--expert-model-parallel-size", "2", "--nproc-per-node", "2"], root)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    said = "is cut short (100 of" if damage == "cut" else "is missing"
    assert f"{shard.name} {said}" in line and "the checkpoint is damaged" in line, line
    assert not out.exists()
