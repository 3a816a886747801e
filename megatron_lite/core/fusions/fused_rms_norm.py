"""RMSNorm that saves what Transformer Engine's and PyTorch's CUDA kernel save: its input (in the
activation dtype) and the per-token rstd (fp32), not the fp32 tensors of the composite.

``torch.nn.RMSNorm`` on a CPU runs the composite ops (upcast, square, mean, rsqrt, two products), and
autograd saves their fp32 operands: for a bf16 input an fp32 copy of it and ``x * rstd`` beside the
rstd, 8 bytes a hidden element where TE's ``RMSNorm`` (megatron-core's norm under ``--transformer-impl
transformer_engine``) keeps the 2-byte input. Per layer that is two norms, on every microbatch in
flight. Here the forward is ``torch._fused_rms_norm``, which is the CUDA kernel on a GPU and the same
composite on a CPU (the same bits as ``F.rms_norm``), and the backward recomputes the normalised input
from the saved input and rstd: ``aten._fused_rms_norm_backward`` on CUDA; on other devices its formula
in fp32 (PyTorch has no CPU kernel for it), with one hidden-sized fp32 buffer per term at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Where PyTorch has a kernel for aten._fused_rms_norm_backward (its CPU build has none).
KERNEL_DEVICES = {"cuda"}


def _backward_fp32(grad, x, rstd, weight, needs: tuple[bool, bool]):
    """(input gradient, weight gradient) of ``x * rstd * weight``: the kernel's formula, computed in
    fp32 (or wider) from the saved input, and cast back."""
    x_hat = x * rstd  # promotes to rstd's fp32
    g = grad.to(x_hat.dtype)
    grad_weight = None
    if needs[1]:
        grad_weight = (g * x_hat).reshape(-1, x.size(-1)).sum(0).to(weight.dtype)
    if not needs[0]:
        return None, grad_weight
    g = g * weight if weight is not None else g.clone()  # a buffer of its own: written in place below
    dot = (x_hat * g).sum(-1, keepdim=True).div_(x.size(-1))
    grad_input = g.sub_(x_hat.mul_(dot)).mul_(rstd)
    return grad_input.to(x.dtype), grad_weight


class FusedRMSNormFunction(torch.autograd.Function):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, saving ``x`` and the rstd."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        out, rstd = torch._fused_rms_norm(x, list(normalized_shape), weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized_shape = list(normalized_shape)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1])
        if grad.device.type in KERNEL_DEVICES:
            grad_input, grad_weight = torch.ops.aten._fused_rms_norm_backward(
                grad.contiguous(), x, ctx.normalized_shape, rstd, weight, list(needs)
            )
        else:
            grad_input, grad_weight = _backward_fp32(grad, x, rstd, weight, needs)
        return grad_input, grad_weight, None, None


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` (its parameters, state-dict keys and forward values) over the last
    dimension, whose backward keeps only the input and the rstd (``FusedRMSNormFunction``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        needs_graph = torch.is_grad_enabled() and (
            x.requires_grad or (self.weight is not None and self.weight.requires_grad)
        )
        if not needs_graph or len(self.normalized_shape) != 1:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return FusedRMSNormFunction.apply(x, self.weight, self.normalized_shape, self.eps)
