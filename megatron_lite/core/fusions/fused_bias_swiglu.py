"""SwiGLU that keeps only its input for backward, as megatron.core.fusions.fused_bias_swiglu.

``silu(gate) * value`` through autograd saves the gate and value (fc1's output), ``silu(gate)`` and,
for the routed experts, the product too (multiplied by each row's routing probability): one or two
more ``[tokens, ffn]`` tensors per layer and microbatch than megatron-core's fused function, which
saves fc1's output (and the probabilities) and recomputes ``silu(gate)`` in backward. These do the
same. The backward runs autograd's own ops (``silu``, ``silu_backward``, the products), so the
gradients are bitwise those of the unfused expression.
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
        gate, value = y.chunk(2, dim=-1)
        grad_gate = torch.ops.aten.silu_backward(grad * value, gate)
        return torch.cat([grad_gate, grad * F.silu(gate)], dim=-1)


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
        act = F.silu(gate)
        product = act * value
        grad_weights = (grad * product).sum(dim=-1, keepdim=True)
        grad_product = grad * weights
        grad_gate = torch.ops.aten.silu_backward(grad_product * value, gate)
        return torch.cat([grad_gate, grad_product * act], dim=-1), grad_weights


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU of fc1's output, saving only that output."""
    return SwiGLUFunction.apply(y)


def weighted_swiglu(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """SwiGLU of fc1's output times each row's weight, saving only those two."""
    return WeightedSwiGLUFunction.apply(y, weights)


def fuses(config) -> bool:
    """Whether the gated MLP's activation is SwiGLU (silu), the one this module fuses."""
    return bool(config.gated_linear_unit) and config.activation_func is F.silu
