"""MoELayer (megatron.core.transformer.moe.moe_layer): route, dispatch, run the local experts,
combine, and add the shared expert. It stands where a dense layer has its MLP (``mlp``)."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core.process_group_utils import get_pg_rank, get_pg_size
from megatron_lite.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron_lite.core.transformer.moe.router import TopKRouter
from megatron_lite.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron_lite.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron_lite.core.transformer.transformer_config import TransformerConfig


def moe_layer_pattern(config: TransformerConfig) -> list[int]:
    """1 for each MoE layer, 0 for each dense one (upstream's ``moe_layer_freq``: every n-th layer
    from the first, or a flag per layer); all 0 for a dense model."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def is_moe_layer(config: TransformerConfig, layer_number: int) -> bool:
    """Whether the layer ``layer_number`` (1-based, global) is a MoE layer."""
    return bool(moe_layer_pattern(config)[layer_number - 1])


class MoELayer(nn.Module):
    """``router``, ``experts`` (this rank's ``num_experts / ep`` of them) and ``shared_experts``.
    Collective over the expert-parallel groups (and, with a load-balancing loss under sequence or
    context parallelism, the group splitting the sequence) in forward and backward."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        layer_number: int,
        pg_collection,
        seed: int,
        init_method,
        output_layer_init_method,
    ):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        ep_rank, ep_size = get_pg_rank(pg_collection.ep), get_pg_size(pg_collection.ep)
        self.num_local_experts = config.num_moe_experts // ep_size
        offset = ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(offset, offset + self.num_local_experts))
        seq_group = pg_collection.tp_cp if config.sequence_parallel else pg_collection.cp
        self.router = TopKRouter(config, layer_number=layer_number, seq_group=seq_group)
        experts = TEGroupedMLP if config.moe_grouped_gemm else SequentialMLP
        self.experts = experts(
            config,
            self.num_local_experts,
            offset,
            layer_number=layer_number,
            etp=(get_pg_rank(pg_collection.expt_tp), get_pg_size(pg_collection.expt_tp)),
            seed=seed,
        )
        dispatcher = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}[
            config.moe_token_dispatcher_type
        ]
        self.token_dispatcher = dispatcher(
            self.num_local_experts, self.local_expert_indices, config, pg_collection
        )
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpertMLP(
                config,
                init_method=init_method,
                output_layer_init_method=output_layer_init_method,
                tp_group=pg_collection.tp,
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        probs, routing_map = self.router(hidden_states)
        tokens, tokens_per_expert, token_probs = self.token_dispatcher.token_permutation(
            hidden_states, probs, routing_map
        )
        expert_output = self.experts(tokens, tokens_per_expert, token_probs)
        output = self.token_dispatcher.token_unpermutation(expert_output)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output
