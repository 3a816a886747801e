"""SwiGLU that keeps only its input for backward, as megatron.core.fusions.fused_bias_swiglu.

``silu(gate) * value`` through autograd saves the gate and value (fc1's output), ``silu(gate)`` and,
for the routed experts, the product too (multiplied by each row's routing probability): one or two
more ``[tokens, ffn]`` tensors per layer and microbatch than megatron-core's fused function, which
saves fc1's output (and the probabilities) and recomputes ``silu(gate)`` in backward. These do the
same. The backward runs autograd's own ops (``silu``, ``silu_backward``, the products), so the
gradients are bitwise those of the unfused expression, and writes them into the two halves of its
output: beside the incoming gradient it holds only the output, as megatron-core's fused kernel does
(each intermediate is a half of the output before it is overwritten).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLUFunction(torch.autograd.Function):
    """``silu(y1) * y2`` for ``y = [y1; y2]`` along the last dimension; saves ``y``."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        gate, value = y.chunk(2, dim=-1)
        return F.silu(gate) * value

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return _swiglu_grad(y, grad)


class WeightedSwiGLUFunction(torch.autograd.Function):
    """``silu(y1) * y2 * weights`` (a routed expert's rows times their probabilities, ``weights`` [rows,
    1] in ``y``'s dtype); saves ``y`` and ``weights``."""

    @staticmethod
    def forward(ctx, y, weights):
        ctx.save_for_backward(y, weights)
        gate, value = y.chunk(2, dim=-1)
        return F.silu(gate) * value * weights

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensors
        gate, value = y.chunk(2, dim=-1)
        product = F.silu(gate) * value
        grad_weights = (grad * product).sum(dim=-1, keepdim=True)
        del product
        return _swiglu_grad(y, grad * weights), grad_weights


def _swiglu_grad(y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``[silu'(gate) * grad * value, grad * silu(gate)]``, each op autograd's own and rounded as there,
    computed in the halves of the result."""
    gate, value = y.chunk(2, dim=-1)
    out = torch.empty_like(y)
    grad_gate, grad_value = out.chunk(2, dim=-1)
    torch.mul(grad, value, out=grad_value)
    torch.ops.aten.silu_backward.grad_input(grad_value, gate, grad_input=grad_gate)
    torch.ops.aten.silu.out(gate, out=grad_value)
    grad_value.mul_(grad)
    return out


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU of fc1's output, saving only that output."""
    return SwiGLUFunction.apply(y)


def weighted_swiglu(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """SwiGLU of fc1's output times each row's weight, saving only those two."""
    return WeightedSwiGLUFunction.apply(y, weights)


def fuses(config) -> bool:
    """Whether the gated MLP's activation is SwiGLU (silu), the one this module fuses."""
    return bool(config.gated_linear_unit) and config.activation_func is F.silu
