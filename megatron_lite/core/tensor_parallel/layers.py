"""Linear and embedding layers whose weights are split across tensor-parallel ranks, with
megatron.core.tensor_parallel.layers' constructors.

A ``tp_group`` of None means parallel_state's tensor-parallel group once it is initialised, and no
tensor parallelism before. Every rank draws the full master weight and keeps its slice (upstream's
"CPU initialisation", whatever ``use_cpu_initialization`` says), so a model starts identical under any
layout; ``use_cpu_initialization`` only chooses where the parameters are allocated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.model_parallel_config import ModelParallelConfig
from megatron_lite.core.parallel_state import get_tensor_model_parallel_rank  # noqa: F401 (upstream's name here)
from megatron_lite.core.tensor_parallel.embedding_grad import embedding
from megatron_lite.core.tensor_parallel.linear_wgrad import (
    LinearWithGradAccumulationAndAsyncCommunication,
    defers_wgrad,
)
from megatron_lite.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_lite.core.tensor_parallel.utils import (
    VocabUtility,
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    divide,
    init_partition_,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron_lite.core.utils import get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_gtp_attributes",
    "copy_tensor_model_parallel_attributes",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]


def _device(config: ModelParallelConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _refuse_unsupported(config: ModelParallelConfig, layer: str, **options) -> None:
    for name, bad in options.items():
        if bad:
            raise NotImplementedError(f"{layer}({name}=...) is not supported by megatron_lite")


def _expert_topology(config: ModelParallelConfig, is_expert: bool, tp_group) -> tuple[bool, bool]:
    """``(explicit_expert_comm, use_expert_pgs)`` of an expert layer, as upstream: its tensor-parallel
    collectives are left to the token dispatcher when it is split over experts or expert-TP ranks, and
    its parameters are reduced over the expert data-parallel group (``allreduce`` False) when that
    differs from the dense one (expert parallelism, or an expert-TP size of its own)."""
    expert_parallel = config.expert_model_parallel_size > 1
    explicit_expert_comm = is_expert and (get_pg_size(tp_group) > 1 or expert_parallel)
    etp = config.expert_tensor_parallel_size
    own_etp = etp is not None and etp != config.tensor_model_parallel_size
    return explicit_expert_comm, is_expert and (expert_parallel or own_etp)


def _tp_group(tp_group, pg_collection, is_expert: bool):
    """The layer's tensor-parallel group: the given one, else the collection's (expert TP for an
    expert layer), else parallel_state's."""
    if tp_group is None and pg_collection is not None:
        tp_group = pg_collection.expt_tp if is_expert else pg_collection.tp
    return get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)


def _new_parameter(shape, config: ModelParallelConfig, init_method, partition_dim, rank, world, stride=1):
    """A tensor-parallel parameter of this rank's ``shape``, initialised from the full master weight
    (or left empty when ``config.perform_initialization`` is off)."""
    weight = nn.Parameter(torch.empty(*shape, dtype=config.params_dtype, device=_device(config)))
    if config.perform_initialization:
        init_partition_(weight, init_method, partition_dim, rank, world, stride)
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    weight.allreduce = True  # reduced over the dense data-parallel group (not the expert one)
    return weight


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
    """Trainable linear layer with upstream's signature, without the fused/overlapped kernels: the
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
            1 if gradient_accumulation_fusion else 0,
        )  # fmt: skip
    return F.linear(input, weight, bias)


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns: rank r holds A[:, r]. Returns ``(output, output_bias)``:
    the bias is added unless ``skip_bias_add``, in which case it is returned for the caller to fuse.
    Collective over ``tp_group`` (the input gradient is all-reduced; ``gather_output`` gathers Y).

    ``is_expert``: a routed expert's layer (upstream's). Its group is the expert tensor-parallel one;
    with more than one expert-TP rank or expert parallelism the communication is explicit (upstream's
    ``explicit_expert_comm``: the token dispatcher moves the tokens, no TP collective runs here), and
    with expert parallelism or an expert-TP size of its own the parameters are marked
    ``allreduce=False``, reduced over the expert data-parallel group."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list | None = None,
        grad_output_buffer: list | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group=None,
        name: str | None = None,
        output_dtype: torch.dtype | None = None,
        pg_collection=None,
    ):
        super().__init__()
        _refuse_unsupported(
            config,
            "ColumnParallelLinear",
            keep_master_weight_for_test=keep_master_weight_for_test,
            output_dtype=output_dtype is not None and output_dtype != config.params_dtype,
        )
        self.input_size, self.output_size, self.config, self.name = input_size, output_size, config, name
        self.gather_output, self.skip_bias_add, self.is_expert = gather_output, skip_bias_add, is_expert
        self.disable_grad_reduce, self.sequence_parallel = disable_grad_reduce, config.sequence_parallel
        self.embedding_activation_buffer, self.grad_output_buffer = (
            embedding_activation_buffer,
            grad_output_buffer,
        )
        self.tp_group = _tp_group(tp_group, pg_collection, is_expert)
        self.explicit_expert_comm, use_expert_pgs = _expert_topology(config, is_expert, self.tp_group)
        rank, world = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        self.output_size_per_partition = divide(output_size, world)
        if skip_weight_param_allocation:
            self.weight = None
        else:
            shape = (self.output_size_per_partition, input_size)
            self.weight = _new_parameter(shape, config, init_method, 0, rank, world, stride)
            self.weight.allreduce = not use_expert_pgs
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.output_size_per_partition, dtype=config.params_dtype, device=_device(config))
            )
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            self.bias.allreduce = not use_expert_pgs
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    "ColumnParallelLinear built with skip_weight_param_allocation needs a weight"
                )
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(
                f"supplied weight's shape is {tuple(weight.shape)}, "
                f"not {(self.output_size_per_partition, self.input_size)} as expected"
            )
        bias = None if self.skip_bias_add else self.bias
        deferring = self.deferring_wgrad(weight)
        # An expert layer under expert (tensor) parallelism: the token dispatcher has already gathered
        # its input and reduces its input gradient, so no tensor-parallel collective runs here.
        sequence_parallel = self.sequence_parallel and not self.explicit_expert_comm
        no_reduce = self.disable_grad_reduce or self.explicit_expert_comm
        fusion = self.config.gradient_accumulation_fusion
        if (sequence_parallel or deferring or fusion) and weight.requires_grad:
            input_parallel = input_
            if not (sequence_parallel or no_reduce):
                input_parallel = copy_to_tensor_model_parallel_region(input_, self.tp_group)
            if deferring and defers_wgrad(self.embedding_activation_buffer, self.config.wgrad_deferral_limit):
                # Its values only: the tensor itself would keep this microbatch's graph, and with it the
                # received input and its gradient, alive until the flush.
                self.embedding_activation_buffer.append(input_parallel.detach())
            output = LinearWithGradAccumulationAndAsyncCommunication.apply(
                input_parallel,
                weight,
                bias,
                self.tp_group,
                sequence_parallel,
                self.grad_output_buffer if deferring else None,
                self.config.wgrad_deferral_limit,
                # DDP may reduce the weight's gradient once it is in main_grad, unless it is another
                # layer's (a tied output layer: the embedding's backward adds to it later).
                (2 if weight is self.weight else 1) if fusion else 0,
            )
        elif weight.requires_grad:
            if no_reduce:
                input_parallel = input_
            else:
                input_parallel = copy_to_tensor_model_parallel_region(input_, self.tp_group)
            output = F.linear(input_parallel, weight, bias)
        else:
            if sequence_parallel:
                input_parallel = gather_from_sequence_parallel_region(input_, group=self.tp_group)
            elif no_reduce:
                input_parallel = input_
            else:
                input_parallel = copy_to_tensor_model_parallel_region(input_, self.tp_group)
            output = LinearWithFrozenWeight.apply(input_parallel, weight, bias, False, self.tp_group)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)

    def deferring_wgrad(self, weight: torch.Tensor) -> bool:
        """Whether this forward's weight gradient may be deferred to the pipeline flush: the layer was
        given upstream's two buffers under ``defer_embedding_wgrad_compute``, and this is a training
        forward (an evaluation forward keeps nothing)."""
        return (
            getattr(self.config, "defer_embedding_wgrad_compute", False)
            and self.embedding_activation_buffer is not None
            and self.grad_output_buffer is not None
            and weight.requires_grad
            and torch.is_grad_enabled()
        )


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows: rank r holds A[r]; partial outputs are all-reduced over
    ``tp_group`` (collective) and the whole, duplicated bias is added after. Returns
    ``(output, output_bias)`` as ColumnParallelLinear. ``is_expert`` as ColumnParallelLinear; under
    explicit expert communication the partial output is returned unreduced (``skip_bias_add``)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        name: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        _refuse_unsupported(
            config, "RowParallelLinear", keep_master_weight_for_test=keep_master_weight_for_test
        )
        if config.sequence_parallel and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")
        self.input_size, self.output_size, self.config, self.name = input_size, output_size, config, name
        self.input_is_parallel, self.skip_bias_add, self.is_expert = (
            input_is_parallel,
            skip_bias_add,
            is_expert,
        )
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = _tp_group(tp_group, pg_collection, is_expert)
        self.explicit_expert_comm, use_expert_pgs = _expert_topology(config, is_expert, self.tp_group)
        rank, world = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        self.input_size_per_partition = divide(input_size, world)
        shape = (output_size, self.input_size_per_partition)
        self.weight = _new_parameter(shape, config, init_method, 1, rank, world, stride)
        self.weight.allreduce = not use_expert_pgs
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(output_size, dtype=config.params_dtype, device=_device(config))
            )
            self.bias.allreduce = not use_expert_pgs
            self.bias.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        if self.config.gradient_accumulation_fusion and self.weight.requires_grad:
            partial = LinearWithGradAccumulationAndAsyncCommunication.apply(
                input_, self.weight, None, self.tp_group, False, None, 0, 2
            )
        else:
            partial = F.linear(input_, self.weight)
        if self.explicit_expert_comm:
            # The token dispatcher reduces the partial outputs (and adds the bias after it).
            assert self.skip_bias_add, "an expert RowParallelLinear returns its bias (skip_bias_add)"
            output = partial
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank looks up only the ids it owns and the
    partial embeddings are all-reduced over ``tp_group`` (collective)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method,
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group=None,
        pg_collection=None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.config = num_embeddings, embedding_dim, config
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.tp
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        rank, world = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, world
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        shape = (self.num_embeddings_per_partition, embedding_dim)
        self.weight = _new_parameter(shape, config, init_method, 0, rank, world)
        # Set by a model that also uses the weight elsewhere on this rank (a tied output layer).
        self.weight_used_elsewhere = False

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        def lookup(ids):
            return embedding(ids, self.weight, weight_used_elsewhere=self.weight_used_elsewhere)

        if get_pg_size(self.tp_group) == 1:
            output = lookup(input_)
        else:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
            output = lookup(local_ids).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            # [b, s, h] -> [s, b, h], then each rank keeps its share of the sequence.
            return reduce_scatter_to_sequence_parallel_region(
                output.transpose(0, 1).contiguous(), self.tp_group
            )
        if get_pg_size(self.tp_group) == 1:
            return output
        return reduce_from_tensor_model_parallel_region(output, self.tp_group)
