"""Autograd-aware communication between the tensor-parallel ranks, as megatron.core.tensor_parallel.mappings.

Each mapping is collective over ``group`` in forward or backward (or both), so every rank of the
tensor-parallel group must call it. A group of None (no tensor parallelism) or of size 1 makes each
the identity. The public wrappers take ``group=None`` to mean parallel_state's tensor-parallel group
once it is initialised. The "tensor model parallel" mappings split or gather the last dimension
(hidden); the "sequence parallel" ones the first (sequence).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.process_group_utils import get_pg_size, get_tensor_model_parallel_group_if_none
from megatron_lite.core.tensor_parallel.collectives import _gather, _reduce, _reduce_scatter, _split


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce the gradient backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        return input_

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output.clone(), ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        return _reduce(input_.clone(), group)

    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_.clone(), group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; gather the gradient backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        return _split(input_, group, -1)

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split(input_, group, -1)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather(grad_output, ctx.group, -1), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Gather the last dimension from all ranks; keep this rank's slice of the gradient backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        return _gather(input_, group, -1)

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather(input_, group, -1)

    @staticmethod
    def backward(ctx, grad_output):
        return _split(grad_output, ctx.group, -1), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the first dimension; gather the gradient backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        return _split(input_, group, 0)

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split(input_, group, 0)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather(grad_output, ctx.group, 0), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Gather the first dimension. Backward: reduce-scatter the gradient when the computation after
    the gather is itself tensor-parallel (``tensor_parallel_output_grad``), else just split it."""

    @staticmethod
    def symbolic(
        graph,
        input_,
        group,
        tensor_parallel_output_grad=True,
        output_split_sizes=None,
        use_global_buffer=False,
    ):
        return _gather(input_, group, 0, output_split_sizes)

    @staticmethod
    def forward(
        ctx, input_, group, tensor_parallel_output_grad=True, output_split_sizes=None, use_global_buffer=False
    ):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.output_split_sizes = output_split_sizes
        ctx.use_global_buffer = use_global_buffer
        return _gather(input_, group, 0, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            grad = _reduce_scatter(grad_output, ctx.group, 0, ctx.output_split_sizes)
        else:
            assert ctx.output_split_sizes is None, "uneven splits need tensor_parallel_output_grad"
            grad = _split(grad_output, ctx.group, 0)
        return grad, None, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter the first dimension; gather the gradient backward."""

    @staticmethod
    def symbolic(graph, input_, group, input_split_sizes=None, use_global_buffer=False):
        return _reduce_scatter(input_, group, 0, input_split_sizes)

    @staticmethod
    def forward(ctx, input_, group, input_split_sizes=None, use_global_buffer=False):
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        ctx.use_global_buffer = use_global_buffer
        return _reduce_scatter(input_, group, 0, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather(grad_output, ctx.group, 0, ctx.input_split_sizes), None, None, None


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """Gather the last dimension; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather(input_, group, -1)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter(grad_output, ctx.group, -1), None


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Reduce-scatter the last dimension; gather the gradient backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter(input_, group, -1)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather(grad_output, ctx.group, -1), None


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    return _CopyToModelParallelRegion.apply(input_, get_tensor_model_parallel_group_if_none(group))


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    return _ReduceFromModelParallelRegion.apply(input_, get_tensor_model_parallel_group_if_none(group))


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    return _ScatterToModelParallelRegion.apply(input_, get_tensor_model_parallel_group_if_none(group))


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    return _GatherFromModelParallelRegion.apply(input_, get_tensor_model_parallel_group_if_none(group))


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    return _ScatterToSequenceParallelRegion.apply(input_, get_tensor_model_parallel_group_if_none(group))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group=None,
    output_split_sizes: list[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    group = get_tensor_model_parallel_group_if_none(group)
    return _GatherFromSequenceParallelRegion.apply(
        input_, group, tensor_parallel_output_grad, output_split_sizes, use_global_buffer
    )


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group=None,
    input_split_sizes: list[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    group = get_tensor_model_parallel_group_if_none(group)
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group, input_split_sizes, use_global_buffer)


def all_gather_last_dim_from_tensor_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    return _AllGatherFromTensorParallelRegion.apply(input_, get_tensor_model_parallel_group_if_none(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    return _ReduceScatterToTensorParallelRegion.apply(input_, get_tensor_model_parallel_group_if_none(group))


class _AllToAll(torch.autograd.Function):
    """Rank r sends ``input_split_sizes[j]`` rows to rank j and receives ``output_split_sizes[j]``
    from it; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = (
            group,
            output_split_sizes,
            input_split_sizes,
        )
        if get_pg_size(group) == 1:
            return input_
        input_ = input_.contiguous()
        rows = input_.size(0) if output_split_sizes is None else sum(output_split_sizes)
        output = input_.new_empty((rows, *input_.shape[1:]))
        dist.all_to_all_single(
            output,
            input_,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
        )
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad = _AllToAll.apply(ctx.group, grad_output, ctx.input_split_sizes, ctx.output_split_sizes)
        return None, grad, None, None


def all_to_all(group, input_: torch.Tensor, output_split_sizes=None, input_split_sizes=None) -> torch.Tensor:
    """Exchange rows of ``input_`` between the ranks of ``group`` (upstream's all_to_all): collective
    over ``group`` in forward and backward. Split sizes are lists of row counts, None for equal ones."""
    return _AllToAll.apply(group, input_, output_split_sizes, input_split_sizes)
