"""The functional linears of megatron.core.tensor_parallel.layers (importable there): a frozen weight's,
which computes no weight gradient, and a trainable one's, which takes upstream's autograd function
(linear_wgrad) where sequence parallelism, a deferred or a fused weight gradient needs it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.core.process_group_utils import get_pg_size, get_tensor_model_parallel_group_if_none
from megatron_lite.core.tensor_parallel.linear_wgrad import LinearWithGradAccumulationAndAsyncCommunication
from megatron_lite.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


class LinearWithFrozenWeight(torch.autograd.Function):
    """``input @ weight.T + bias`` for a weight without gradient: backward computes the input
    gradient only, all-reduced over ``tp_group`` when ``allreduce_dgrad``."""

    @staticmethod
    def forward(ctx, input_, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        return F.linear(input_, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight.to(grad_output.dtype))
        if ctx.allreduce_dgrad and get_pg_size(ctx.tp_group) > 1:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group=None,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    gtp_remat_size: int = 1,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Linear layer whose weight is frozen (no weight gradient, no weight activations kept).
    Collective over ``tp_group`` in backward when ``allreduce_dgrad``, and in forward under
    ``sequence_parallel`` (the input is gathered along the sequence)."""
    assert grad_output_buffer is None, (
        "grad_output_buffer needs linear_with_grad_accumulation_and_async_allreduce"
    )
    assert wgrad_deferral_limit is None, (
        "wgrad_deferral_limit needs linear_with_grad_accumulation_and_async_allreduce"
    )
    if gtp_remat_size != 1 or (output_dtype is not None and output_dtype != input.dtype):
        raise NotImplementedError(
            "GTP remat and mixed-precision linear outputs are not supported by megatron_lite"
        )
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad, tp_group)


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer=None,
    wgrad_deferral_limit: int | None = 0,
    tp_group=None,
    gtp_remat_size: int = 1,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Trainable linear layer with upstream's signature, without the overlapped kernels: the
    input-gradient all-reduce (``allreduce_dgrad``) runs after the GEMM, not overlapped with it.
    With a ``grad_output_buffer`` the weight gradients of the first ``wgrad_deferral_limit``
    backwards (0: all) are deferred (linear_wgrad). Collective over ``tp_group`` as
    ``linear_with_frozen_weight``. ``gradient_accumulation_fusion``: the weight gradient goes into
    ``weight.main_grad`` where it has one (fusions/fused_weight_gradient)."""
    if gtp_remat_size != 1 or (output_dtype is not None and output_dtype != input.dtype):
        raise NotImplementedError(
            "GTP remat and mixed-precision linear outputs are not supported by megatron_lite"
        )
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if allreduce_dgrad and not sequence_parallel:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    if sequence_parallel or grad_output_buffer is not None or gradient_accumulation_fusion:
        return LinearWithGradAccumulationAndAsyncCommunication.apply(
            input, weight, bias, tp_group, sequence_parallel, grad_output_buffer, wgrad_deferral_limit or 0,
            gradient_accumulation_fusion,
        )  # fmt: skip
    return F.linear(input, weight, bias)
