"""Linear layers whose weights are split across tensor-parallel ranks, with megatron.core.tensor_parallel
.layers' constructors (the embedding and the functional linears live in files of their own, importable
here). A ``tp_group`` of None means parallel_state's group once initialised, and no tensor parallelism
before. Every rank draws the full master weight and keeps its slice (upstream's "CPU initialisation",
whatever ``use_cpu_initialization`` says, which only chooses where parameters live), so a model starts
identical under any layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.model_parallel_config import ModelParallelConfig
from megatron_lite.core.parallel_state import get_tensor_model_parallel_rank  # noqa: F401 (upstream's name here)
from megatron_lite.core.process_group_utils import (
    get_pg_rank,
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)
from megatron_lite.core.tensor_parallel.linear_functions import (
    LinearWithFrozenWeight,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
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
from megatron_lite.core.tensor_parallel.utils import (  # noqa: F401 (as upstream)
    VocabUtility,
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    divide,
    init_partition_,
    new_partitioned_parameter,
    param_is_not_tensor_parallel_duplicate,
    parameter_device,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron_lite.core.tensor_parallel.vocab_parallel_embedding import VocabParallelEmbedding

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
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        self.tp_group = _tp_group(tp_group, pg_collection, is_expert)
        self.explicit_expert_comm, use_expert_pgs = _expert_topology(config, is_expert, self.tp_group)
        rank, world = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        self.output_size_per_partition = divide(output_size, world)
        if skip_weight_param_allocation:
            self.weight = None
        else:
            shape = (self.output_size_per_partition, input_size)
            self.weight = new_partitioned_parameter(shape, config, init_method, 0, rank, world, stride)
            self.weight.allreduce = not use_expert_pgs
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(
                    self.output_size_per_partition, dtype=config.params_dtype, device=parameter_device(config)
                )
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
                fusion,
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
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.is_expert = is_expert
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = _tp_group(tp_group, pg_collection, is_expert)
        self.explicit_expert_comm, use_expert_pgs = _expert_topology(config, is_expert, self.tp_group)
        rank, world = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        self.input_size_per_partition = divide(input_size, world)
        shape = (output_size, self.input_size_per_partition)
        self.weight = new_partitioned_parameter(shape, config, init_method, 1, rank, world, stride)
        self.weight.allreduce = not use_expert_pgs
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(output_size, dtype=config.params_dtype, device=parameter_device(config))
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
                input_, self.weight, None, self.tp_group, False, None, 0, True
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
