"""Gradient-accumulation fusion (Megatron-LM's default, ``--no-gradient-accumulation-fusion`` to turn it
off): linear layers add their weight gradient straight into DDP's fp32 ``main_grad``. The oracle is the
unfused path (autograd's gradient added into main_grad) and fp64 arithmetic; the memory oracle is the
CPU allocator's own account under torch.profiler."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import SMALL_MODEL, ok, parse_losses, run_pretrain
from memory_measure import profiler_peak_and_final
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lite.core.fusions import fused_weight_gradient as fwg
from megatron_lite.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.core.transformer.transformer_config import TransformerConfig

TOKENS, IN, OUT = 48, 64, 96


def _operands(dtype):
    torch.manual_seed(0)
    x, g = torch.randn(TOKENS, IN, dtype=dtype), torch.randn(TOKENS, OUT, dtype=dtype)
    start = torch.randn(OUT, IN)  # an earlier microbatch's gradient, added to
    exact = start.double() + g.double().t() @ x.double()
    return x, g, start, exact


def test_fp32_adds_in_place_with_no_weight_sized_temporary():
    x, g, start, exact = _operands(torch.float32)
    main_grad = start.clone()
    peak, _, _ = profiler_peak_and_final(lambda: fwg.wgrad_gemm_accum_fp32(x, g, main_grad))
    assert torch.allclose(main_grad.double(), exact, rtol=0, atol=1e-4)
    assert peak < OUT * IN * 4 // 4, peak


def test_bf16_sums_in_fp32_a_slice_of_tokens_at_a_time(monkeypatch):
    """No fp32-output GEMM on the CPU: 5 tokens upcast at a time (the budget here), each product of two
    bf16 values exact in fp32, so the sum is fp32's, with no bf16 rounding on the way; the temporaries
    are the slices, far below the weight-sized gradient the unfused path makes."""
    monkeypatch.setitem(fwg.CHUNK_BUDGET_BYTES, "cpu", 5 * 4 * (IN + OUT))
    assert fwg.upcast_token_rows(IN, OUT, "cpu") == 5
    x, g, start, exact = _operands(torch.bfloat16)
    main_grad = start.clone()
    peak, _, _ = profiler_peak_and_final(lambda: fwg.wgrad_gemm_accum_fp32(x, g, main_grad))
    assert torch.allclose(main_grad.double(), exact, rtol=0, atol=1e-4)
    assert peak <= 5 * 4 * (IN + OUT) + 1024 < OUT * IN * 2, peak
    unfused = start + (g.t() @ x).float()  # autograd's bf16 gradient, then DDP's add
    assert (main_grad.double() - exact).abs().max() < (unfused.double() - exact).abs().max() / 10


def test_cuda_takes_the_fp32_output_gemm_into_main_grad(mocker):
    """On CUDA (no GPU here) the GEMM writes its fp32 result into main_grad itself: the aten op's own
    shape and dtype rules accept the call under fake tensors, and a stand-in for its kernel gives the
    sum."""
    mocker.patch.object(fwg, "kernel_device_type", return_value="cuda")
    with FakeTensorMode():
        main_grad = torch.zeros(OUT, IN)
        fwg.wgrad_gemm_accum_fp32(torch.ones(TOKENS, IN, dtype=torch.bfloat16), torch.ones(TOKENS, OUT, dtype=torch.bfloat16), main_grad)  # fmt: skip
    kernel = mocker.patch.object(
        torch.ops.aten.addmm,
        "dtype_out",
        side_effect=lambda c, a, b, dtype, out: out.copy_(c + a.to(dtype) @ b.to(dtype)),
    )
    x, g, start, exact = _operands(torch.bfloat16)
    main_grad = start.clone()
    fwg.wgrad_gemm_accum_fp32(x, g, main_grad)
    assert kernel.call_count == 1 and kernel.call_args.kwargs["out"] is main_grad
    assert kernel.call_args.args[3] == torch.float32
    assert torch.allclose(main_grad.double(), exact, rtol=0, atol=1e-4)


def _config(fusion: bool, dtype=torch.float32) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=IN, num_attention_heads=4, params_dtype=dtype,
        gradient_accumulation_fusion=fusion,
    )  # fmt: skip


@pytest.mark.parametrize("layer", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_adds_into_main_grad_and_tells_ddp(layer, dtype):
    """With fusion the layer's weight gets no .grad: its gradient is in main_grad (the unfused one, added
    to what was there) and DDP's hook (autograd's post-accumulate hook, which fires though no gradient
    was returned) hears of it once per backward; without a main_grad (no DDP) the weight gets
    autograd's gradient as unfused."""
    kwargs = dict(init_method=torch.nn.init.normal_, bias=False, skip_bias_add=False)
    if layer is RowParallelLinear:
        kwargs["input_is_parallel"] = True
    torch.manual_seed(0)
    plain, fused = (layer(IN, OUT, config=_config(f, dtype), **kwargs) for f in (False, True))
    fused.weight.data.copy_(plain.weight.data)
    x = torch.randn(4, TOKENS // 4, IN, dtype=dtype)
    grad = torch.randn(4, TOKENS // 4, OUT, dtype=dtype)
    plain(x)[0].backward(grad)
    fused.weight.main_grad = torch.full((OUT, IN), 0.25)
    heard = []
    fused.weight.register_post_accumulate_grad_hook(heard.append)
    x_fused = x.clone().requires_grad_(True)
    fused(x_fused)[0].backward(grad)
    assert fused.weight.grad is None and heard == [fused.weight]
    added, unfused = fused.weight.main_grad - 0.25, plain.weight.grad.float()
    assert torch.allclose(added, unfused, rtol=2**-8, atol=1e-5), (added - unfused).abs().max()
    del fused.weight.main_grad
    fused(x)[0].backward(grad)
    assert torch.equal(fused.weight.grad, plain.weight.grad)


def test_a_tied_weight_is_final_only_after_its_other_use():
    """An output layer given the embedding's weight adds its part into main_grad; autograd calls the
    weight's post-accumulate hook (DDP's) once, after the embedding lookup's part has arrived too, so
    what DDP adds and reduces is final."""
    layer = ColumnParallelLinear(
        IN, OUT, config=_config(True), init_method=torch.nn.init.normal_, bias=False,
        skip_weight_param_allocation=True,
    )  # fmt: skip
    shared = torch.nn.Parameter(torch.randn(OUT, IN))
    shared.main_grad, seen = torch.zeros(OUT, IN), []
    shared.register_post_accumulate_grad_hook(lambda p: seen.append((p.grad.clone(), p.main_grad.clone())))
    hidden = torch.nn.functional.embedding(torch.tensor([[1, 5, 5]]), shared)
    layer(hidden, weight=shared)[0].sum().backward()
    assert len(seen) == 1
    lookup_grad, main_grad = seen[0]
    assert lookup_grad.abs().sum(dim=1).nonzero().flatten().tolist() == [1, 5]  # the lookup's part
    assert main_grad.abs().sum() > 0  # the layer's part, already in main_grad


@pytest.mark.world
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_losses_with_and_without_fusion(tmp_path, dtype):
    """A real dp 2 x pp 2 world with the distributed optimizer and overlapped gradient reduction (the
    layers tell DDP when a gradient is in main_grad): fp32 losses within 1e-6 of the unfused ones; bf16
    near them (the unfused path rounds each weight gradient to bf16 before adding it, the fused one does
    not)."""
    args = [
        *SMALL_MODEL, "--train-iters", "4", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "4",
        "--use-distributed-optimizer", "--overlap-grad-reduce", *(["--bf16"] if dtype == "bf16" else []),
    ]  # fmt: skip
    fused = parse_losses(ok(run_pretrain(args, tmp_path)).stdout)
    plain = parse_losses(ok(run_pretrain([*args, "--no-gradient-accumulation-fusion"], tmp_path)).stdout)
    assert sorted(fused) == sorted(plain) == [1, 2, 3, 4] and fused[1] == plain[1]
    tolerance = 1e-6 if dtype == "fp32" else 1e-4
    assert all(abs(fused[it] - plain[it]) <= tolerance * abs(plain[it]) for it in plain), (fused, plain)
