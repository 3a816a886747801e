"""The trainable linear's autograd function, with upstream's deferred weight gradient.

``LinearWithGradAccumulationAndAsyncCommunication`` computes ``gather(input) @ weight.T + bias``: under
sequence parallelism the input is a sequence shard [s / tp, b, in], gathered for the GEMM and dropped,
so the layer keeps s / tp rows (upstream's memory saving); backward gathers it again for the weight
gradient and reduce-scatters the input gradient.

Given a ``grad_output_buffer`` (upstream's ``--defer-embedding-wgrad-compute``, on the output layer of
the last pipeline stage), backward appends its output gradient there instead of computing the weight
gradient, for the first ``wgrad_deferral_limit`` microbatches of a step (0: all of them); the layer keeps
their inputs in its ``embedding_activation_buffer``. :func:`drain_wgrad` then runs those GEMMs in
microbatch order at the pipeline flush, while the other stages are still finishing their backwards,
adding each into the weight's ``main_grad`` as the undeferred backward would have: the same GEMM (the
fused one with gradient-accumulation fusion), the same order, the same bits.

With ``gradient_accumulation_fusion`` (and a weight that has DDP's fp32 ``main_grad``) the weight gradient
is added straight into ``main_grad`` (fusions/fused_weight_gradient), as megatron-core's is: no
weight-sized gradient exists, and autograd receives none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lite.core.fusions.fused_weight_gradient import wgrad_gemm_accum_fp32
from megatron_lite.core.tensor_parallel.collectives import _gather, _reduce_scatter


def _wgrad(grad_output: torch.Tensor, total_input: torch.Tensor) -> torch.Tensor:
    """dL/dW = grad_output^T input over all tokens: the GEMM (and so the bits) of F.linear's backward."""
    flat_grad = grad_output.reshape(-1, grad_output.size(-1))
    return flat_grad.t().mm(total_input.reshape(-1, total_input.size(-1)))


def defers_wgrad(grad_output_buffer: list | None, wgrad_deferral_limit: int | None) -> bool:
    """Whether the next backward defers its weight gradient (upstream's limit test: 0 defers all)."""
    if grad_output_buffer is None:
        return False
    return not wgrad_deferral_limit or len(grad_output_buffer) < wgrad_deferral_limit


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """Collective over ``tp_group`` in forward and backward under ``sequence_parallel``; local otherwise
    (the caller copies the input into the tensor-parallel region, whose backward all-reduces).
    With ``gradient_accumulation_fusion`` autograd is returned no weight gradient; its post-accumulate
    hook still fires (DDP's, once every use of a tied weight is done), and DDP finds no ``.grad`` to add."""

    @staticmethod
    def forward(
        ctx,
        input_,
        weight,
        bias,
        tp_group,
        sequence_parallel=True,
        grad_output_buffer=None,
        wgrad_deferral_limit=0,
        gradient_accumulation_fusion=False,
    ):
        ctx.save_for_backward(input_, weight)
        # The parameter's own attribute: a saved tensor may come back as another object.
        ctx.main_grad = getattr(weight, "main_grad", None) if gradient_accumulation_fusion else None
        ctx.has_bias, ctx.tp_group, ctx.sequence_parallel = bias is not None, tp_group, sequence_parallel
        ctx.grad_output_buffer, ctx.wgrad_deferral_limit = grad_output_buffer, wgrad_deferral_limit
        total_input = _gather(input_, tp_group, 0) if sequence_parallel else input_
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        deferred = defers_wgrad(ctx.grad_output_buffer, ctx.wgrad_deferral_limit)
        if deferred:
            # Its values only: an fp32 cross entropy's gradient is the logits tensor itself (made the
            # softmax in place, as megatron-core's), whose graph would stay alive until the flush.
            ctx.grad_output_buffer.append(grad_output.detach())
        grad_input = grad_output.matmul(weight.to(grad_output.dtype))
        if ctx.sequence_parallel:
            grad_input = _reduce_scatter(grad_input, ctx.tp_group, 0)
        grad_weight = None
        if not deferred:
            total_input = _gather(input_, ctx.tp_group, 0) if ctx.sequence_parallel else input_
            if ctx.main_grad is not None:
                wgrad_gemm_accum_fp32(total_input, grad_output, ctx.main_grad)
            else:
                grad_weight = _wgrad(grad_output, total_input).to(weight.dtype)
        grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


@torch.no_grad()
def drain_wgrad(
    embedding_activation_buffer: list,
    grad_output_buffer: list,
    weight: torch.Tensor,
    tp_group,
    sequence_parallel: bool,
    gradient_accumulation_fusion: bool = False,
) -> None:
    """Add the deferred weight gradients into ``weight.main_grad`` (``weight.grad`` for a weight without
    one), oldest microbatch first, emptying both buffers as it goes; with ``gradient_accumulation_fusion``
    the GEMM adds into ``main_grad`` itself. Collective over ``tp_group`` under ``sequence_parallel``
    (each input is gathered again)."""
    if len(embedding_activation_buffer) != len(grad_output_buffer):
        raise RuntimeError(
            f"deferred wgrad: {len(embedding_activation_buffer)} inputs but "
            f"{len(grad_output_buffer)} output gradients"
        )
    while grad_output_buffer:
        input_, grad_output = embedding_activation_buffer.pop(0), grad_output_buffer.pop(0)
        total_input = _gather(input_, tp_group, 0) if sequence_parallel else input_
        main_grad = getattr(weight, "main_grad", None)
        if gradient_accumulation_fusion and main_grad is not None and not callable(grad_output):
            wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
            del input_, total_input, grad_output
            continue
        # The fused loss (fusions/fused_linear_cross_entropy) defers a callable, not a gradient; it
        # adds into main_grad itself where the weight has one (returning None).
        grad = grad_output(total_input) if callable(grad_output) else _wgrad(grad_output, total_input)
        del input_, total_input, grad_output  # each microbatch's buffers go as soon as they are used
        if grad is None:
            continue
        if main_grad is not None:
            main_grad.add_(grad)  # what DDP's accumulation does with a computed gradient
        elif weight.grad is None:
            weight.grad = grad.to(weight.dtype)
        else:
            weight.grad.add_(grad)


def drain_embedding_wgrad_compute(config, embedding_activation_buffer, grad_output_buffer, weight, tp_group):
    """Run the output layer's deferred weight-gradient GEMMs (``--defer-embedding-wgrad-compute``) at
    the pipeline flush, adding each into ``weight.main_grad`` (upstream's name, in megatron.core.utils).
    Collective over ``tp_group`` under sequence parallelism."""
    drain_wgrad(
        embedding_activation_buffer,
        grad_output_buffer,
        weight,
        tp_group,
        config.sequence_parallel,
        getattr(config, "gradient_accumulation_fusion", False),
    )
