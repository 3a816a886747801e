"""One LoRA adapter per local expert of a grouped expert layer (Megatron-Bridge's
``GroupedExpertLinearAdapter``, used with ``share_expert_adapters=False``): ``linear_in.weight`` is
``(local experts, dim, in)`` and ``linear_out.weight`` ``(local experts, out, dim)`` (the expert-TP
split as ``ParallelLinearAdapter``'s), expert i's pair applied to the rows routed to it. Reduced over
the expert data-parallel group (``allreduce=False``) like the expert weights; its checkpoint tensors
have the global expert axis first, so they reshard across expert-parallel sizes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core import parallel_state
from megatron_lite.core.dist_checkpointing.mapping import ShardedTensor
from megatron_lite.core.process_group_utils import get_pg_rank, get_pg_size
from megatron_lite.core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron_lite.core.tensor_parallel.utils import (
    divide,
    init_partition_,
    set_tensor_model_parallel_attributes,
)
from megatron_lite.core.utils import seeded_init
from megatron_lite.peft.init_methods import get_init_fn
from megatron_lite.peft.lora_merge import LoRAMerge
from megatron_lite.peft.parallel_adapter import _ACTIVATIONS, ADAPTER_INIT_SEED
from megatron_lite.peft.sharding import strided_factory


class _GroupedExpertAdapterWeight(nn.Module):
    """Holds one stacked weight (Bridge's container, so the key is ``linear_in.weight``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, indices: list[int] | None = None) -> torch.Tensor:
        return self.weight if indices is None else self.weight[indices]


class GroupedExpertLinearAdapter(nn.Module):
    """A LoRA pair per local expert. ``first_expert``: the global index of local expert 0 (each
    expert's pair is drawn by its global index, so any EP layout starts the same)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dim: int,
        *,
        num_local_experts: int,
        base_linear_name: str,
        activation: str = "swish",
        column_init_method: str = "xavier",
        row_init_method: str = "zero",
        input_is_parallel: bool = False,
        dropout: float = 0.0,
        model_parallel_config=None,
        alpha: float | None = None,
        dropout_position: str = "pre",
        base_linear_is_parallel: bool = True,
        tp_group=None,
        lora_dtype: torch.dtype | None = None,
        init_key: str | None = None,
        first_expert: int = 0,
        out_stride: int = 1,
    ) -> None:
        super().__init__()
        self.base_linear_name = base_linear_name
        self.activation = _ACTIVATIONS.get(activation, nn.Identity)()
        self.dim, self.alpha = dim, (alpha if alpha is not None else dim)
        self.input_is_parallel, self.dropout_position = input_is_parallel, dropout_position
        self.base_linear_is_parallel, self.is_expert = base_linear_is_parallel, True
        self.num_local_experts, self.first_expert = num_local_experts, first_expert
        self.tp_group = tp_group
        rank, size = get_pg_rank(tp_group), get_pg_size(tp_group)
        dtype = lora_dtype or model_parallel_config.params_dtype
        in_axis = 1 if input_is_parallel else 0  # per expert: row-parallel splits A's columns
        in_shape = (dim, divide(in_features, size)) if input_is_parallel else (divide(dim, size), in_features)
        out_shape = (divide(out_features, size), dim)
        key = init_key or base_linear_name
        ins, outs = [], []
        for e in range(num_local_experts):
            for shapes, axis, stride, method, part, where in (
                (in_shape, in_axis, 1, column_init_method, "linear_in", ins),
                (out_shape, 0, out_stride, row_init_method, "linear_out", outs),
            ):
                w = torch.empty(shapes, dtype=dtype)
                with seeded_init(ADAPTER_INIT_SEED, f"lora {key} expert {first_expert + e} {part}"):
                    init_partition_(w, get_init_fn(method), axis, rank, size, stride)
                where.append(w)
        self.linear_in = _GroupedExpertAdapterWeight(torch.stack(ins))
        self.linear_out = _GroupedExpertAdapterWeight(torch.stack(outs))
        for w, axis, stride in (
            (self.linear_in.weight, in_axis + 1, 1),
            (self.linear_out.weight, 1, out_stride),
        ):
            set_tensor_model_parallel_attributes(w, True, axis, stride)
            w.allreduce = False
        self.dropout = nn.Dropout(dropout) if dropout > 0.0 else nn.Identity()

    @property
    def scale(self) -> float:
        return self.alpha / self.dim

    def _one(self, x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
        """One expert's pair, communication as ``ParallelLinearAdapter._expert_forward``."""
        w_in, w_out = w_in.to(x.dtype), w_out.to(x.dtype)
        many = get_pg_size(self.tp_group) > 1
        if self.input_is_parallel:
            if many:
                w_out = gather_from_sequence_parallel_region(w_out, group=self.tp_group)
            return F.linear(self.activation(F.linear(x, w_in)), w_out)
        h = F.linear(x, w_in)
        if many:
            h = all_gather_last_dim_from_tensor_parallel_region(h, self.tp_group)
        return F.linear(self.activation(h), w_out)

    def forward(self, x: torch.Tensor, tokens_per_expert=None, *args, **kwargs) -> torch.Tensor:
        if tokens_per_expert is None:
            raise ValueError(f"{self.base_linear_name}: a per-expert adapter needs the tokens per expert")
        if self.dropout_position == "pre":
            x = self.dropout(x)
        # Called as modules, so DDP's forward pre-hooks (overlapped parameter gather) see them.
        w_in, w_out = self.linear_in(), self.linear_out()
        parts = [
            self._one(rows, w_in[e], w_out[e]) for e, rows in enumerate(x.split(list(tokens_per_expert)))
        ]
        out = torch.cat(parts) if parts else x.new_empty((0, self.linear_out.weight.shape[1]))
        if self.dropout_position == "post":
            out = self.dropout(out)
        return out * self.scale

    @torch.no_grad()
    def merge_into(self, base: nn.Module) -> None:
        """Fold expert i's pair into the base's ``weight<i>`` (collective over the expert-TP group)."""
        for e, weight in enumerate(base.weights()):
            merged = LoRAMerge().merge(
                weight,
                self.linear_out.weight[e],
                self.linear_in.weight[e],
                self.alpha,
                self.dim,
                tp_group=self.tp_group,
            )
            weight.copy_(merged)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The stacked weights with their global expert axis (this EP rank's experts) and expert-TP split."""
        initialized = parallel_state.model_parallel_is_initialized()
        ep_rank = parallel_state.get_expert_model_parallel_rank() if initialized else 0
        ep_size = parallel_state.get_expert_model_parallel_world_size() if initialized else 1
        edp = parallel_state.get_expert_data_parallel_rank() if initialized else 0
        tp_rank, tp_size = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        n = len(sharded_offsets)
        out = {}
        for name, w in self.state_dict(prefix="", keep_vars=True).items():
            offsets = [*sharded_offsets, (n, ep_rank, ep_size)]
            if tp_size > 1 and w.partition_stride > 1:  # a gated fc1's [gate; up] rows
                out[prefix + name] = strided_factory(
                    prefix + name, w, tuple(offsets), n, tp_rank, tp_size, (0, 0, edp)
                )
                continue
            if tp_size > 1:
                offsets.append((n + w.partition_dim, tp_rank, tp_size))
            out[prefix + name] = ShardedTensor.from_rank_offsets(
                prefix + name, w, *offsets, replica_id=(0, 0, edp), prepend_axis_num=n
            )
        return out
