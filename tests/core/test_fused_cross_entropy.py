"""--cross-entropy-loss-fusion: the output layer and the vocab-parallel cross entropy over chunks of
tokens. The unfused path is the oracle: the same losses and gradients (in one process and over real gloo
worlds at every layout the parity tests cover), a real run's measured allocated peak smaller by at
least the logits, the prediction beside the dry run, and the preflight proposing it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import SMALL_MODEL, ok, parse_losses, run_pretrain
from memory_measure import measure

from megatron_lite.core.fusions import fused_weight_gradient as wgrad_module
from megatron_lite.core.fusions.fused_linear_cross_entropy import linear_cross_entropy
from megatron_lite.core.tensor_parallel import vocab_parallel_cross_entropy

FUSED = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-chunk-tokens", "24"]


def _one_process(dtype: torch.dtype, chunk: int):
    """(loss, input gradient, weight gradient) unfused, then fused, for [s 16, b 3, h 32] x vocab 96."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, 32, dtype=dtype)
    w = (torch.randn(96, 32) / 4).to(dtype)
    target, g = torch.randint(0, 96, (16, 3)), torch.rand(16, 3)
    results = []
    for fused in (False, True):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fused:
            loss = linear_cross_entropy(xi, wi, target, chunk_tokens=chunk)
        else:
            loss = vocab_parallel_cross_entropy(F.linear(xi, wi), target)
        (loss * g).sum().backward()
        results.append((loss.detach(), xi.grad, wi.grad))
    return results


@pytest.mark.parametrize("chunk", [48, 7, 1000])  # whole chunks, a ragged last one, one chunk
def test_losses_and_gradients_are_the_unfused_ones(chunk):
    (loss, gx, gw), (f_loss, f_gx, f_gw) = _one_process(torch.float32, chunk)
    assert f_loss.shape == loss.shape and f_loss.dtype == torch.float32
    for ours, theirs in ((f_loss, loss), (f_gx, gx), (f_gw, gw)):
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), (ours - theirs).abs().max()


def test_bf16_in_one_chunk_is_bitwise_the_unfused_path():
    """The same GEMM, upcast, max, shift, exp, sum and softmax as the unfused path: the same bits. With
    several chunks only the weight gradient's sum over tokens is split (bf16 partial sums)."""
    (loss, gx, gw), (f_loss, f_gx, f_gw) = _one_process(torch.bfloat16, 1000)
    assert torch.equal(f_gx, gx) and torch.equal(f_gw, gw)
    assert torch.allclose(f_loss, loss, rtol=2e-7, atol=0)  # log(sum) - shifted target: one rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_gradient_goes_into_main_grad(dtype, monkeypatch):
    """Given DDP's fp32 main_grad the chunks add their weight gradients into it, as upstream's
    gradient-accumulation fusion (no weight-sized gradient, none returned to autograd); bf16 upcast 5
    tokens at a time (no fp32-output GEMM on the CPU). fp32: the unfused gradient; bf16: summed in fp32
    with no rounding on the way, so within the unfused gradient's one bf16 rounding (2^-8 of each)."""
    monkeypatch.setitem(wgrad_module.CHUNK_BUDGET_BYTES, "cpu", 5 * 4 * (32 + 96))
    (loss, gx, gw), _ = _one_process(dtype, 7)
    torch.manual_seed(0)
    x = torch.randn(16, 3, 32, dtype=dtype).requires_grad_(True)
    w = (torch.randn(96, 32) / 4).to(dtype).requires_grad_(True)
    target, g = torch.randint(0, 96, (16, 3)), torch.rand(16, 3)
    w.main_grad = torch.full(w.shape, 0.5)  # a previous microbatch's gradient, added to
    f_loss = linear_cross_entropy(x, w, target, chunk_tokens=7)
    (f_loss * g).sum().backward()
    assert w.grad is None and torch.equal(f_loss, loss) and torch.equal(x.grad, gx)
    added, gw = w.main_grad - 0.5, gw.float()
    if dtype == torch.float32:
        assert torch.allclose(added, gw, rtol=1e-6, atol=1e-7), (added - gw).abs().max()
    else:
        bound = 2**-8 * gw.abs() + 1e-6 * gw.abs().max()  # half a bf16 unit in the last place
        assert ((added - gw).abs() <= bound).all(), ((added - gw).abs() - bound).max()


LAYOUTS = {
    "tp 2": ["--tensor-model-parallel-size", "2"],
    "tp 2 sp, pp 2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"],
    "cp 2, untied": ["--context-parallel-size", "2", "--untie-embeddings-and-output-weights"],
    "pp 2 deferred wgrad": ["--pipeline-model-parallel-size", "2", "--defer-embedding-wgrad-compute"],
}  # fmt: skip


@pytest.mark.world
@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_losses_match_the_unfused_run(tmp_path, layout):
    args = [*SMALL_MODEL, "--train-iters", "4", *LAYOUTS[layout]]
    plain = parse_losses(ok(run_pretrain(args, tmp_path)).stdout)
    fused = parse_losses(ok(run_pretrain([*args, *FUSED], tmp_path)).stdout)
    assert sorted(fused) == sorted(plain) == [1, 2, 3, 4]
    for it in plain:
        assert abs(fused[it] - plain[it]) <= 1e-6 * abs(plain[it]), (it, fused[it], plain[it])


@pytest.mark.world
def test_bf16_training_losses(tmp_path):
    """bf16 at tp 2 with SP and pp 2, with gradient-accumulation fusion (the default, Megatron-LM's):
    both paths sum the output layer's weight gradient in fp32 straight into main_grad, so the losses
    agree within 1e-6 step after step (without it the unfused path rounds the whole sum to bf16 once,
    and the losses move by about 1e-5 after an update)."""
    args = [*SMALL_MODEL, "--train-iters", "4", "--bf16", *LAYOUTS["tp 2 sp, pp 2"]]
    plain = parse_losses(ok(run_pretrain(args, tmp_path)).stdout)
    fused = parse_losses(ok(run_pretrain([*args, *FUSED], tmp_path)).stdout)
    assert sorted(fused) == sorted(plain) == [1, 2, 3, 4]
    assert all(abs(fused[it] - plain[it]) <= 1e-6 * abs(plain[it]) for it in plain), (fused, plain)


@pytest.mark.world
def test_a_real_runs_last_stage_peak_shrinks_by_at_least_the_logits(tmp_path):
    """pp 2 at vocabulary 32768 in bf16 on the CPU, measured by the allocated-bytes tracker
    (mem-max-allocated): the last stage's peak falls by more than one microbatch's logits (it held them
    and their fp32 copy at once; the fused loss holds one chunk's), and both runs' peaks are what the
    prediction says."""
    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
        "--vocab-size 32768 --micro-batch-size 4 --global-batch-size 8 --train-iters 2 --log-interval 1 "
        "--pipeline-model-parallel-size 2 --bf16"
    ).split()
    plain = measure(argv, 2, tmp_path / "plain", quiet=True)[-1]["peak"]
    fused = measure([*argv, "--cross-entropy-loss-fusion"], 2, tmp_path / "fused", quiet=True)[-1]["peak"]
    logits = 256 * 4 * 32768 * 2 / 1e9
    assert plain[0] - fused[0] >= logits, (plain, fused)
    for measured, predicted in (plain, fused):
        assert abs(measured - predicted) <= 0.03 * measured, (measured, predicted)


@pytest.mark.world
@pytest.mark.parametrize("layout", ["--bf16", "--tensor-model-parallel-size 2 --sequence-parallel --bf16",
                                    "--tensor-model-parallel-size 4 --sequence-parallel --cross-entropy-fusion-chunk-tokens 64",
                                    "--pipeline-model-parallel-size 2 --defer-embedding-wgrad-compute"])  # fmt: skip
def test_the_prediction_is_the_dry_runs(layout):
    """The last stage's peak, predicted and measured on fake tensors, within 1%: under SP one chunk's
    gathered rows and reduce-scattered gradient at a time (8 chunks of 16 rows per rank at 64)."""
    from megatron_lite.run_modes.dry_run import dry_run_stages
    from megatron_lite.training.arguments import config_from_argv
    from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

    argv = (
        "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
        "--vocab-size 8192 --micro-batch-size 2 --global-batch-size 32 --nproc-per-node 8 "
        f"--cross-entropy-loss-fusion {layout}"
    ).split()
    config = config_from_argv(argv)
    predicted = predict_memory_per_stage(config, device_type="cuda")[-1].peak_bytes
    dry = dry_run_stages(config, device_type="cuda")[-1].max_allocated_bytes
    assert abs(predicted - dry) <= 0.01 * dry, (predicted, dry)


@pytest.mark.world
def test_the_preflight_proposes_it_when_the_last_stage_does_not_fit(tmp_path):
    argv = (
        "--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length 4096 --max-position-embeddings 4096 "
        "--vocab-size 256000 --micro-batch-size 4 --global-batch-size 64 --bf16 --pipeline-model-parallel-size 2 "
        "--nproc-per-node 2 --memory-preflight --device-memory-gb 16"
    ).split()
    result = run_pretrain(argv, tmp_path)
    assert result.returncode == 1 and "stage 1 runs out first" in result.stdout
    assert "cheapest change that fits every stage: --cross-entropy-loss-fusion " in result.stdout


@pytest.mark.world
def test_transformer_engine_impl_is_one_line_and_exit_2(tmp_path):
    result = run_pretrain([*SMALL_MODEL, *FUSED, "--cross-entropy-fusion-impl", "te"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        == "pretrain.py: error: --cross-entropy-fusion-impl: te needs Transformer Engine; use native"
    )
