"""What a layer's ops keep for backward is what Transformer Engine's and megatron-core's keep (issue 45):
the RMSNorm its input and per-token rstd (TE's ``RMSNorm``, PyTorch's CUDA kernel), not the CPU
composite's fp32 tensors; the MoE combine its indices (megatron-core's ``unpermute``, a scatter_add),
not its source; SwiGLU's backward, as megatron-core's fused kernel, holds only its result beside the
incoming gradient. Measured by PyTorch's own allocator events (torch.profiler) and saved-tensor hooks;
torch's own module and ops are the oracle for the values."""

from __future__ import annotations

import pytest
import torch
from memory_measure import profiler_peak_and_final

from megatron_lite.core.fusions.fused_bias_swiglu import swiglu, weighted_swiglu
from megatron_lite.core.fusions.fused_rms_norm import RMSNorm
from megatron_lite.core.transformer.moe.moe_utils import combine_rows

TOKENS, HIDDEN = 256, 512


def _saved(fn):
    """(fn's result, the (shape, dtype, data pointer) of every tensor autograd saves during it)."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _norms(dtype):
    torch.manual_seed(0)
    theirs = torch.nn.RMSNorm(HIDDEN, eps=1e-5, dtype=dtype)
    ours = RMSNorm(HIDDEN, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(HIDDEN) * 0.1 + 1)
        ours.weight.copy_(theirs.weight)
    x = (torch.randn(TOKENS, 2, HIDDEN) * 3).to(dtype)
    return theirs, ours, x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_keeps_its_input_and_rstd_and_gives_torchs_values(dtype):
    theirs, ours, x = _norms(dtype)
    x_theirs, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ours, saved = _saved(lambda: ours(x_ours))
    y_theirs = theirs(x_theirs)
    # The input itself (no copy), the weight, and one fp32 rstd per token.
    assert sorted(saved, key=str) == sorted(
        [
            (tuple(x.shape), dtype, x_ours.data_ptr()),
            ((HIDDEN,), dtype, ours.weight.data_ptr()),
            ((TOKENS, 2, 1), torch.float32, saved[-1][2]),
        ],
        key=str,
    )
    assert torch.equal(y_ours, y_theirs)  # the same forward ops, the same bits
    grad = torch.randn_like(y_theirs)
    y_ours.backward(grad)
    y_theirs.backward(grad)
    # The backward recomputes x * rstd instead of reading a saved copy: the same formula, other roundings.
    tol = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2**-7, 2**-7)}[dtype]
    for a, b in ((x_ours.grad, x_theirs.grad), (ours.weight.grad, theirs.weight.grad)):
        scale = b.float().abs().max()
        assert torch.allclose(a.float(), b.float(), rtol=tol[0], atol=tol[1] * scale), (a - b).abs().max()


def test_rms_norm_holds_a_quarter_of_the_composites_bytes_in_bf16():
    """Held from forward to backward by one bf16 norm, beyond its input and output: the composite keeps
    an fp32 copy of the input and x * rstd (8 bytes an element); ours the rstd alone."""
    theirs, ours, x = _norms(torch.bfloat16)
    held = {}
    for name, norm in (("theirs", theirs), ("ours", ours)):
        xi = x.clone().requires_grad_(True)
        held[name] = (
            profiler_peak_and_final(lambda n=norm, xi=xi: n(xi))[1] - xi.numel() * 2
        )  # less the output
    elements = TOKENS * 2 * HIDDEN
    assert held["theirs"] >= 8 * elements, held
    assert held["ours"] <= TOKENS * 2 * 4 + 1024, held  # the rstd (and the allocator's rounding)


def test_the_kernel_path_passes_the_kernels_arguments(mocker):
    """On CUDA the backward is aten._fused_rms_norm_backward (no GPU here): its arguments, in its order,
    checked by PyTorch's own Python decomposition of that op standing in for the kernel."""
    from torch._decomp.decompositions import _fused_rms_norm_backward

    from megatron_lite.core.fusions import fused_rms_norm

    mocker.patch.object(fused_rms_norm, "KERNEL_DEVICES", {"cpu"})
    kernel = mocker.patch.object(
        torch.ops.aten, "_fused_rms_norm_backward", side_effect=_fused_rms_norm_backward
    )
    theirs, ours, x = _norms(torch.float32)
    x_theirs, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    grad = torch.randn_like(x)
    ours(x_ours).backward(grad)
    theirs(x_theirs).backward(grad)
    assert kernel.call_count == 1
    assert torch.allclose(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-5)


def test_no_graph_needed_is_torchs_own_call():
    _, ours, x = _norms(torch.bfloat16)
    with torch.no_grad():
        y, saved = _saved(lambda: ours(x))
    assert saved == [] and torch.equal(y, torch.nn.functional.rms_norm(x, (HIDDEN,), ours.weight, 1e-5))


def test_moe_combine_keeps_its_indices_only_and_gives_index_adds_values():
    torch.manual_seed(0)
    source = torch.randn(3 * TOKENS, HIDDEN, dtype=torch.bfloat16)
    index = torch.randint(0, TOKENS, (3 * TOKENS,))
    ours_in, theirs_in = source.clone().requires_grad_(True), source.clone().requires_grad_(True)
    out, saved = _saved(lambda: combine_rows(ours_in, index, TOKENS))
    assert saved == [(tuple(index.shape), torch.int64, index.data_ptr())]
    expected = theirs_in.new_zeros((TOKENS, HIDDEN)).index_add(0, index, theirs_in)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(ours_in.grad, theirs_in.grad)


@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_backward_holds_only_its_result_and_gives_autograds_bits(weighted):
    """The unfused expression through autograd is the oracle for the bits; the allocator's events show
    the backward's peak is its [t, 2f] result (autograd's ops would hold three [t, f] more)."""
    torch.manual_seed(0)
    y = torch.randn(TOKENS, 2 * HIDDEN, dtype=torch.bfloat16)
    probs, grad = (
        torch.rand(TOKENS, 1, dtype=torch.bfloat16),
        torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16),
    )
    ours_y, theirs_y = y.clone().requires_grad_(True), y.clone().requires_grad_(True)
    ours_p, theirs_p = probs.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    ours = weighted_swiglu(ours_y, ours_p) if weighted else swiglu(ours_y)
    gate, value = theirs_y.chunk(2, dim=-1)
    theirs = torch.nn.functional.silu(gate) * value * (theirs_p if weighted else 1)
    assert torch.equal(ours, theirs)
    peak, _, _ = profiler_peak_and_final(lambda: ours.backward(grad))
    theirs.backward(grad)
    assert torch.equal(ours_y.grad, theirs_y.grad)
    if weighted:
        assert torch.equal(ours_p.grad, theirs_p.grad)
    result = y.numel() * y.element_size()
    extra = 2 * TOKENS * HIDDEN * 2 if weighted else 0  # the weighted one's grad * probs and product
    assert result <= peak <= result + extra + 4096, (peak, result)
