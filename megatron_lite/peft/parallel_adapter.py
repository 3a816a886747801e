"""Megatron-Bridge's ``ParallelLinearAdapter``: ``scale * linear_out(act(linear_in(dropout(x))))``,
split over the base layer's tensor-parallel group the way Bridge splits it, so the adapter's
output lands exactly where the base layer's does.

- Column-parallel base (``linear_qkv``, ``linear_fc1``): ``linear_in`` is column-parallel
  ``(dim/tp, in)`` with its output gathered, ``linear_out`` column-parallel ``(out/tp, dim)``: the
  output is this rank's columns, as the base's. Under sequence parallelism the input (the
  layer norm's output, split by sequence) is gathered first.
- Row-parallel base (``linear_proj``, ``linear_fc2``): ``linear_in`` is row-parallel
  ``(dim, in/tp)`` (its partial outputs all-reduced), ``linear_out`` column-parallel
  ``(out/tp, dim)`` with its output gathered; under sequence parallelism the result is split by
  sequence, as the base's reduce-scatter leaves its output.
- ``sequence_parallel_input_regather`` (Bridge's option; a column-parallel base under sequence
  parallelism): ``linear_in`` gathers its sequence-split input itself, through the sequence-parallel
  linear of core (``LinearWithGradAccumulationAndAsyncCommunication``), which keeps only this rank's
  slice [s/tp, b, h] for the weight gradient, gathers it again in backward and reduce-scatters the
  input gradient; the standard path keeps the gathered [s, b, h]. Same numbers, 1/tp of the memory.
- A routed expert's layer (``is_expert``): the expert tensor-parallel group, no sequence
  parallelism, and the communication a dispatcher-fed expert needs (its input whole on every
  expert-TP rank, its output partial sums that the dispatcher's combine adds up): see
  ``_expert_forward``. Its parameters are reduced over the expert data-parallel group
  (``allreduce=False``), like the expert weights.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.model_parallel_config import ModelParallelConfig
from megatron_lite.core.process_group_utils import get_pg_size, get_tensor_model_parallel_group_if_none
from megatron_lite.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_lite.core.utils import seeded_init
from megatron_lite.peft.init_methods import get_init_fn

_ACTIVATIONS = {
    "identity": nn.Identity,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "swish": nn.SiLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
}

# Adapter weights are drawn from an RNG keyed by the base layer's global name, so every layout (TP,
# PP, EP) starts from the same adapters; a fixed seed, as the base model's own draws are.
ADAPTER_INIT_SEED = 1234


def hooked_weight(module: nn.Module) -> torch.Tensor:
    """``module.weight`` for a GEMM done outside ``module``'s forward, after its forward pre-hooks ran:
    DDP's overlapped parameter gather waits for the weight's update in such a hook."""
    for hook in list(module._forward_pre_hooks.values()):
        hook(module, ())
    return module.weight


class ParallelLinearAdapter(nn.Module):
    """Bridge's signature; megatron_lite adds keyword-only ``tp_group`` (the base layer's group;
    None: parallel_state's, the expert one for an expert), ``ep_group`` (an adapter shared by the
    experts of every expert-parallel rank sums its gradients over it), ``lora_dtype`` (the
    parameters' dtype, None: the model's), ``init_key`` (the name its weights are drawn by; None:
    ``base_linear_name``) and ``out_stride`` (the base's output stride: 2 for a gated ``linear_fc1``,
    whose rows on each rank are its gate slice then its up slice; ``linear_out`` is split the same
    way, so its rows add to the rows they belong to whatever the layout). ``a2a_experimental`` is
    refused; ``sequence_parallel_input_regather`` keeps ``linear_in``'s input split by sequence
    (see the module docstring) where it applies: a non-expert column-parallel base under sequence
    parallelism at TP > 1; elsewhere it changes nothing."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dim: int,
        base_linear_name: str,
        activation: str = "swish",
        column_init_method: str = "xavier",
        row_init_method: str = "zero",
        input_is_parallel: bool = False,
        dropout: float = 0.0,
        model_parallel_config: ModelParallelConfig | None = None,
        alpha: float | None = None,
        dropout_position: str = "pre",
        a2a_experimental: bool = False,
        is_expert: bool = False,
        disable_tensor_parallel_comm: bool = False,
        disable_sequence_parallel_comm: bool = True,
        base_linear_is_parallel: bool = True,
        pg_collection=None,
        sequence_parallel_input_regather: bool = False,
        *,
        tp_group=None,
        ep_group=None,
        lora_dtype: torch.dtype | None = None,
        init_key: str | None = None,
        out_stride: int = 1,
    ) -> None:
        super().__init__()
        if a2a_experimental:
            raise ValueError(
                "LoRA a2a_experimental (all-to-all adapter output) is not supported by megatron_lite"
            )
        if dropout_position not in ("pre", "post"):
            raise ValueError(f"LoRA dropout_position must be 'pre' or 'post', not {dropout_position!r}")
        if not base_linear_is_parallel:
            raise ValueError(f"LoRA on {base_linear_name}: a non-parallel base layer is not supported")
        self.base_linear_name = base_linear_name
        self.activation = _ACTIVATIONS.get(activation, nn.Identity)()
        self.dim = dim
        self.alpha = alpha if alpha is not None else dim
        self.input_is_parallel = input_is_parallel
        self.dropout_position = dropout_position
        self.use_a2a = False
        self.is_expert = is_expert
        self.base_linear_is_parallel = base_linear_is_parallel
        self.sequence_parallel_input_regather = sequence_parallel_input_regather
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.expt_tp if is_expert else pg_collection.tp
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        self.ep_group = ep_group

        # The adapter's own linears: no sequence parallelism (handled here), always initialised (a
        # base built with perform_initialization off still needs its adapters drawn), in lora_dtype.
        base_config = model_parallel_config if model_parallel_config is not None else ModelParallelConfig()
        sequence_parallel = base_config.sequence_parallel and not is_expert
        config = copy.copy(base_config)
        config.sequence_parallel = False
        config.perform_initialization = True
        if lora_dtype is not None:
            config.params_dtype = lora_dtype
        self.config = config
        key = init_key or base_linear_name
        with seeded_init(ADAPTER_INIT_SEED, f"lora {key} linear_in"):
            if input_is_parallel:
                self.linear_in = RowParallelLinear(
                    in_features, dim, config=config, init_method=get_init_fn(column_init_method),
                    bias=False, input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group,
                )  # fmt: skip
            else:
                self.linear_in = ColumnParallelLinear(
                    in_features, dim, config=config, init_method=get_init_fn(column_init_method),
                    bias=False, gather_output=True, disable_grad_reduce=sequence_parallel,
                    tp_group=self.tp_group,
                )  # fmt: skip
        with seeded_init(ADAPTER_INIT_SEED, f"lora {key} linear_out"):
            # Mirrors the base: a column base keeps its output split (gather_output False), a row
            # base's output is whole, so linear_out gathers.
            self.linear_out = ColumnParallelLinear(
                dim, out_features, config=config, init_method=get_init_fn(row_init_method),
                bias=False, gather_output=input_is_parallel, tp_group=self.tp_group, stride=out_stride,
            )  # fmt: skip
        self.dropout = nn.Dropout(dropout) if dropout > 0.0 else nn.Identity()
        if is_expert:  # reduced over the expert data-parallel group, like the expert weights
            for p in self.parameters():
                p.allreduce = False
        self.disable_sequence_parallel_comm = (
            disable_sequence_parallel_comm or not sequence_parallel or not base_linear_is_parallel
        )
        self.disable_tensor_parallel_comm = disable_tensor_parallel_comm
        # Bridge's eligible adapters: a column-parallel, non-expert base under SP at TP > 1 (its other
        # fallbacks, CUDA graphs, CPU offload, TE's fused paths, do not exist here). The numbers are
        # the standard path's for any activation, and under recompute too (which keeps no more).
        self.regathers_input = bool(
            sequence_parallel_input_regather
            and not self.disable_sequence_parallel_comm
            and not input_is_parallel
            and not is_expert
            and get_pg_size(self.tp_group) > 1
        )
        # linear_in's own sequence-parallel path gathers the input and keeps this rank's slice.
        self.linear_in.sequence_parallel = self.regathers_input

    @property
    def scale(self) -> float:
        return self.alpha / self.dim

    def _ep_shared(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as used by an adapter shared over the expert-parallel ranks: its gradient is
        summed over them in backward (each rank saw other tokens), as Bridge's shared expert adapter."""
        if self.ep_group is None or get_pg_size(self.ep_group) == 1:
            return weight
        return copy_to_tensor_model_parallel_region(weight, self.ep_group)

    def _expert_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter of an expert layer fed by the token dispatcher. Column base (fc1): the input is
        whole on every expert-TP rank; ``linear_in``'s slices are gathered (gradients
        reduce-scattered) and ``linear_out`` gives this rank's output columns; the input gradient is
        this rank's part, which the dispatcher sums. Row base (fc2): the input is this rank's
        columns, the output a partial sum the dispatcher's combine adds up: ``linear_in`` gives a
        partial low-rank activation and ``linear_out``'s rows are gathered (gradients
        reduce-scattered), so the partial outputs sum to ``B (A x)``."""
        w_in = self._ep_shared(hooked_weight(self.linear_in)).to(x.dtype)
        w_out = self._ep_shared(hooked_weight(self.linear_out)).to(x.dtype)
        if self.input_is_parallel:
            h = self.activation(F.linear(x, w_in))
            if get_pg_size(self.tp_group) > 1:
                w_out = gather_from_sequence_parallel_region(w_out, group=self.tp_group)
            return F.linear(h, w_out)
        h = F.linear(x, w_in)
        if get_pg_size(self.tp_group) > 1:
            h = all_gather_last_dim_from_tensor_parallel_region(h, self.tp_group)
        return F.linear(self.activation(h), w_out)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        del args, kwargs
        if self.dropout_position == "pre":
            x = self.dropout(x)
        if self.is_expert:
            x = self._expert_forward(x)
        else:
            x = x.to(self.linear_in.weight.dtype)  # lora_dtype may differ from the model's
            if (
                not self.disable_sequence_parallel_comm
                and not self.input_is_parallel
                and not self.regathers_input
            ):
                # linear_qkv / linear_fc1: the layer norm before them is split by sequence; gather it
                # (its backward reduce-scatters, so linear_in skips its own all-reduce). With
                # regather linear_in gathers it and keeps only the local slice.
                x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            x, _ = self.linear_in(x)
            x = self.activation(x)
            x, _ = self.linear_out(x)
            if not self.disable_sequence_parallel_comm and self.input_is_parallel:
                # linear_proj / linear_fc2: the base's output is reduce-scattered by sequence.
                x = scatter_to_sequence_parallel_region(x, group=self.tp_group)
        if self.dropout_position == "post":
            x = self.dropout(x)
        return x * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """``linear_in.weight`` / ``linear_out.weight`` as pieces of their full tensors, split along
        their ``partition_dim`` over the adapter's group."""
        from megatron_lite.peft.sharding import module_sharded_state_dict

        ep_shared = self.ep_group is not None and get_pg_size(self.ep_group) > 1
        return module_sharded_state_dict(self, prefix, sharded_offsets, self.tp_group, ep_shared)
