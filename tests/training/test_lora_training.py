"""LoRA fine-tuning (Megatron-Bridge's PEFT) end to end: the base from --pretrained-checkpoint, frozen;
the same losses as one process at every layout; checkpoints of the adapters only, in both formats,
resumed bitwise and refused onto another base.

Two worlds hold every run (each run sets up its own layout): one process writes the bases, trains the
references, saves and resumes; two processes train the other layouts from the same bases."""

from __future__ import annotations

import os

import pytest
import torch
from dist_helpers import run_world
from lora_helpers import LLAMA, LORA, MIXTRAL, TIED, adapter_weights, train_run

pytestmark = pytest.mark.world  # every test here starts processes

ITERS = 3


def _refusal(argv) -> str:
    """The one line a run of ``argv`` is refused with (setup's CheckpointError)."""
    from megatron_lite.training.checkpointing import CheckpointError

    try:
        train_run(argv, 0)
    except CheckpointError as err:
        return str(err)
    raise AssertionError(f"{argv} was not refused")


def _facts_of(s, base_root) -> dict:
    """What the reference run's model, DDP buffers and optimizer hold, against the base checkpoint."""
    from megatron_lite.training.checkpointing.safety import load_checkpoint_file

    base = load_checkpoint_file(
        os.path.join(base_root, "iter_0000001/mp_rank_00/model_optim_rng.pt"), base_root
    )
    state = s.model[0].state_dict()
    adapters = {p for n, p in s.model[0].named_parameters() if ".adapter." in n}
    in_buffers = {p for buffer in s.model[0].buffers for p in buffer.param_index_map}
    norm = torch.sqrt(sum(p.detach().double().square().sum() for p in adapters)).item()
    return {
        "base_keys_unchanged": all(torch.equal(state[k], v) for k, v in base["model"].items()),
        "base_keys": set(base["model"]) <= set(state),
        "frozen": all(not p.requires_grad for n, p in s.model[0].named_parameters() if ".adapter." not in n),
        "optimizer_holds_adapters_only": {u.param for u in s.optimizer.units} == adapters,
        "ddp_holds_adapters_only": in_buffers == adapters,
        # B (linear_out) starts at zero: the adapters have trained when none is zero any more.
        "adapters_trained": all(
            p.abs().sum() > 0 for n, p in s.model[0].named_parameters() if "linear_out" in n
        ),
        "params_norm_is_the_adapters": abs(s.optimizer.get_params_norm() - norm) <= 1e-6 * norm,
    }


def _saved_keys(root) -> tuple[set, set]:
    """The model keys of a ``torch`` PEFT checkpoint's shard and the tensor keys of a ``torch_dist`` one."""
    from megatron_lite.core.dist_checkpointing import load_metadata
    from megatron_lite.training.checkpointing.safety import load_checkpoint_file

    shard = os.path.join(root, "torch", "iter_0000002/mp_rank_00/model_optim_rng.pt")
    payload = load_checkpoint_file(shard, os.path.join(root, "torch"))
    metadata = load_metadata(os.path.join(root, "torch_dist", "iter_0000002"))
    return set(payload["model"]), set(metadata.state_dict_metadata)


def _one_process(rank, world, root):
    base, base_moe = os.path.join(root, "base"), os.path.join(root, "base_moe")
    # The bases: one full-training step of each shape, in either format.
    train_run([*LLAMA, "--train-iters", "1"], 1, {1: [("torch", base)]})
    train_run([*MIXTRAL, "--train-iters", "1"], 1, {1: [("torch_dist", base_moe)]})
    lora = [*LLAMA, *LORA, "--pretrained-checkpoint", base, "--train-iters", str(ITERS)]
    saves = {2: [("torch", os.path.join(root, "torch")), ("torch_dist", os.path.join(root, "torch_dist"))]}
    s, losses = train_run(lora, ITERS, saves)
    out = {"losses": losses, "facts": _facts_of(s, base), "adapters": adapter_weights(s.model)}
    out["saved_keys"] = _saved_keys(root)
    for fmt in ("torch", "torch_dist"):
        s, resumed = train_run([*lora, "--load", os.path.join(root, fmt)], 1)
        out[f"resumed_{fmt}"] = (resumed, adapter_weights(s.model))
    base_tied = os.path.join(root, "base_tied")
    train_run([*TIED, "--train-iters", "1"], 1, {1: [("torch", base_tied)]})
    tied = [*TIED, *LORA, "--pretrained-checkpoint", base_tied, "--train-iters", str(ITERS)]
    _, out["tied_losses"] = train_run(tied, ITERS)
    _, out["moe_losses"] = train_run(
        [*MIXTRAL, *LORA, "--pretrained-checkpoint", base_moe, "--train-iters", str(ITERS)], ITERS
    )
    adapters = os.path.join(root, "torch")
    out["refusals"] = {
        "another base": _refusal([*LLAMA[2:], "--num-layers", "3", *lora[len(LLAMA) :], "--load", adapters]),
        "without --peft": _refusal([*LLAMA, "--pretrained-checkpoint", base, "--load", adapters]),
        "a full checkpoint": _refusal([*lora, "--load", base]),
        "adapters as the base": _refusal([*LLAMA, *LORA, "--pretrained-checkpoint", adapters]),
        "another rank": _refusal([*lora, "--lora-dim", "8", "--load", adapters]),
    }
    return out


LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
}


def _two_processes(rank, world, root):
    base, base_moe = os.path.join(root, "base"), os.path.join(root, "base_moe")
    lora = [*LLAMA, *LORA, "--pretrained-checkpoint", base, "--train-iters", str(ITERS)]
    out = {}
    for name, flags in LAYOUTS.items():
        s, out[name] = train_run([*lora, *flags], ITERS)
        if name == "dp2-distopt":  # its buffers and this rank's shards: of the adapters only
            adapters = {p for n, p in s.model[0].named_parameters() if ".adapter." in n}
            in_buffers = {p for buffer in s.model[0].buffers for p in buffer.param_index_map}
            out["distopt_holds_adapters_only"] = (
                in_buffers == adapters and {u.param for u in s.optimizer.units} <= adapters
            )
    # Tied embeddings at pp 2: the frozen shared weight joins no gradient all-reduce.
    tied = [*TIED, *LORA, "--pretrained-checkpoint", os.path.join(root, "base_tied")]
    _, out["pp2-tied"] = train_run([*tied, "--train-iters", str(ITERS), *LAYOUTS["pp2"]], ITERS)
    moe = [*MIXTRAL, *LORA, "--pretrained-checkpoint", base_moe, "--train-iters", str(ITERS)]
    _, out["ep2-dp2-distopt"] = train_run(
        [*moe, "--expert-model-parallel-size", "2", "--use-distributed-optimizer"], ITERS
    )
    # A torch_dist PEFT checkpoint saved at tp 1, resumed at tp 2 with sequence parallelism.
    resumed = [*lora, *LAYOUTS["tp2-sp"], "--load", os.path.join(root, "torch_dist")]
    _, out["resumed at tp2-sp"] = train_run(resumed, 1)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    one = run_world(_one_process, 1, root)[0]
    two = run_world(_two_processes, 2, root)[0]
    return one, two


def _close(losses, reference, start=0):
    return all(abs(a - b) <= 5e-4 * abs(b) for a, b in zip(losses, reference[start:], strict=True))


def test_lora_trains_and_only_the_adapters_change(runs):
    one, _ = runs
    assert one["facts"] == dict.fromkeys(one["facts"], True)


@pytest.mark.parametrize("layout", [*LAYOUTS, "pp2-tied", "ep2-dp2-distopt"])
def test_loss_matches_one_process(runs, layout):
    one, two = runs
    references = {"ep2-dp2-distopt": one["moe_losses"], "pp2-tied": one["tied_losses"]}
    reference = references.get(layout, one["losses"])
    assert _close(two[layout], reference), (two[layout], reference)


def test_the_distributed_optimizer_holds_the_adapters_only(runs):
    assert runs[1]["distopt_holds_adapters_only"]


def test_peft_checkpoint_holds_the_adapters_only_in_both_formats(runs):
    torch_keys, dist_keys = runs[0]["saved_keys"]
    assert torch_keys and all(".adapter." in k for k in torch_keys)
    weights = {k for k in dist_keys if not k.startswith("optimizer.")}
    assert weights and all(".adapter." in k for k in dist_keys)
    assert {k.replace("optimizer.state.exp_avg.", "") for k in dist_keys if "exp_avg." in k} == weights


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_is_bitwise(runs, fmt):
    one, _ = runs
    losses, adapters = one[f"resumed_{fmt}"]
    assert torch.equal(losses[0], one["losses"][2])
    assert adapters.keys() == one["adapters"].keys()
    assert all(torch.equal(adapters[k], one["adapters"][k]) for k in adapters)


def test_resume_at_another_layout_reshards_the_adapters(runs):
    one, two = runs
    assert _close(two["resumed at tp2-sp"], one["losses"], start=2)


@pytest.mark.parametrize(
    "case,needle",
    [
        ("another base", "holds adapters for another base"),
        ("without --peft", "holds LoRA adapters only"),
        ("a full checkpoint", "is a full model checkpoint, not LoRA adapters"),
        ("adapters as the base", "holds LoRA adapters only, not a base model"),
        ("another rank", "its adapters have dim=4 but --lora-dim gives dim=8"),
    ],
)
def test_refusals_are_one_line(runs, case, needle):
    line = runs[0]["refusals"][case]
    assert needle in line and "\n" not in line, line
