"""What to load, as upstream: ``--ckpt-step`` (a chosen iteration), ``--pretrained-checkpoint`` (a
finetune source when ``--load`` holds none), ``--load-main-params-from-ckpt`` (fp32 main weights
from the checkpoint when the optimizer state is not loaded), and the schedule check on resume."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import SMALL_MODEL, loss_lines, ok, parse_losses, run_pretrain

pytestmark = pytest.mark.world  # every test here starts processes

ARGS = [*SMALL_MODEL, "--num-workers", "0"]


def refused(result, needle: str) -> str:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.stderr and needle in line, result.stderr
    return line


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An fp32 run of 4 iterations saving at 2 and 4."""
    root = tmp_path_factory.mktemp("ckpt")
    run = ok(run_pretrain([*ARGS, "--train-iters", "4", "--save", "c", "--save-interval", "2"], root))
    return root, run


def test_ckpt_step_resumes_the_chosen_iteration(saved):
    root, straight = saved
    resumed = ok(run_pretrain([*ARGS, "--train-iters", "4", "--load", "c", "--ckpt-step", "2"], root))
    assert sorted(parse_losses(resumed.stdout)) == [3, 4]
    assert loss_lines(resumed.stdout)[3] == loss_lines(straight.stdout)[3]  # bitwise, from iteration 2
    line = refused(
        run_pretrain([*ARGS, "--train-iters", "4", "--load", "c", "--ckpt-step", "3"], root), "--ckpt-step 3"
    )
    assert "iter_0000002, iter_0000004" in line


def test_pretrained_checkpoint_finetunes_when_load_holds_none(saved):
    root, _ = saved
    args = [*ARGS, "--train-iters", "2", "--load", "empty", "--pretrained-checkpoint", "c"]
    tuned = ok(run_pretrain(args, root))
    assert sorted(parse_losses(tuned.stdout)) == [1, 2]  # weights only: the iteration count restarts
    assert "successfully loaded checkpoint from c at iteration 4" in tuned.stdout
    refused(run_pretrain([*args[:-1], "missing"], root), "Pretrained checkpoint missing does not exist")


def test_resume_under_another_schedule_is_refused_unless_overridden(saved):
    root, _ = saved
    args = [*ARGS, "--train-iters", "4", "--load", "c", "--ckpt-step", "2", "--lr", "2e-3"]
    refused(run_pretrain(args, root), "for learning rate do not match")
    ok(run_pretrain([*args, "--override-opt-param-scheduler"], root))


def _weights(path) -> list[torch.Tensor]:
    model = torch.load(path, weights_only=True)["model"]
    return [t for k, t in model.items() if torch.is_tensor(t) and not k.endswith("_extra_state")]


MAIN_PARAMS = {
    "from_ckpt": ["--no-load-optim", "--load-main-params-from-ckpt"],
    "from_model": ["--no-load-optim"],
    "with_optimizer_state": ["--override-opt-param-scheduler"],  # lr 0 is another schedule
}


@pytest.mark.parametrize("mode", list(MAIN_PARAMS))
def test_bf16_main_params_restart_from_the_loaded_weights(saved, mode):
    """bf16 model, fp32 checkpoint, learning rate 0: the main weights saved one iteration later are
    the checkpoint's exactly (``--load-main-params-from-ckpt``, or its optimizer state: an fp32 run's
    weights were its main weights) or their bf16 rounding (the loaded model's, without either), never
    the run's own initial weights."""
    root, _ = saved
    from_ckpt = mode != "from_model"
    out = f"b_{mode}"
    args = [*ARGS, "--bf16", "--load", "c", *MAIN_PARAMS[mode], "--lr", "0", "--min-lr", "0"]
    args += ["--train-iters", "5", "--save", out]
    ok(run_pretrain(args, root))
    fp32 = _weights(root / "c" / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt")
    payload = torch.load(root / out / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    masters = payload["optimizer"]["fp32_from_fp16_params"]
    assert [m.shape for m in masters] == [w.shape for w in fp32]
    expected = fp32 if from_ckpt else [w.bfloat16().float() for w in fp32]
    assert all(torch.equal(m, e) for m, e in zip(masters, expected))
    assert any(not torch.equal(m, w) for m, w in zip(masters, fp32)) != from_ckpt  # rounding shows


def test_distributed_optimizer_main_params_restart_from_the_loaded_weights(saved):
    """The same with the distributed optimizer (its main weights live in distrib_optim.pt): after a
    step at learning rate 0 the bf16 weights written back from them are the checkpoint's, rounded."""
    root, _ = saved
    args = [*ARGS, "--bf16", "--load", "c", "--no-load-optim", "--lr", "0", "--min-lr", "0"]
    args += [
        "--train-iters",
        "5",
        "--save",
        "d",
        "--use-distributed-optimizer",
        "--load-main-params-from-ckpt",
    ]
    ok(run_pretrain(args, root))
    fp32 = _weights(root / "c" / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt")
    bf16 = _weights(root / "d" / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt")
    assert all(torch.equal(b, w.bfloat16()) for b, w in zip(bf16, fp32, strict=True))
