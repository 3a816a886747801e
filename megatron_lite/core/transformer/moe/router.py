"""TopKRouter (megatron.core.transformer.moe.router): scores every expert for every token and picks
each token's top-k, with the load-balancing and z losses attached to the backward pass."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.process_group_utils import get_pg_size
from megatron_lite.core.tensor_parallel.random import is_checkpointing
from megatron_lite.core.tensor_parallel.utils import init_partition_
from megatron_lite.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron_lite.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)
from megatron_lite.core.transformer.transformer_config import TransformerConfig


class TopKRouter(nn.Module):
    """``weight`` [experts, hidden], alike on every tensor-parallel rank. ``seq_group``: the ranks
    holding parts of the same sequences (tensor-parallel ranks under sequence parallelism, context-
    parallel ranks); the load-balancing loss counts tokens over all of them, as upstream's tp_cp group."""

    def __init__(self, config: TransformerConfig, *, layer_number: int, seq_group=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.topk = config.moe_router_topk
        self.num_experts = config.num_moe_experts
        self.seq_group = seq_group
        self.weight = nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            init_partition_(self.weight, config.init_method, None, 0, 1)  # drawn in fp32, as every weight
        # Each sequence-parallel rank sees its own tokens: the gradients add up over TP.
        self.weight.sequence_parallel = config.sequence_parallel
        self.weight.allreduce = True

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight.to(input.dtype))

    def _attach(self, activation: torch.Tensor, name: str, loss: torch.Tensor, coeff: float) -> torch.Tensor:
        """Train ``loss`` through ``activation``'s backward; record ``loss / coeff`` for the logs."""
        get_moe_metrics_tracker().record(name, loss / coeff, self.layer_number, self.config.num_layers)
        return MoEAuxLossAutoScaler.apply(activation, loss)

    def apply_load_balancing_loss(self, logits, probs, num_tokens: int):
        coeff = self.config.moe_aux_loss_coeff
        if self.config.moe_router_load_balancing_type != "aux_loss" or not coeff:
            return probs
        routing_map, scores = compute_routing_scores_for_aux_loss(
            logits, self.topk, self.config.moe_router_score_function
        )
        # Counted over the whole sequence (a collective over seq_group); each rank's probs are its part.
        tokens_per_expert = routing_map.sum(dim=0)
        if get_pg_size(self.seq_group) > 1:
            dist.all_reduce(tokens_per_expert, group=self.seq_group)
        aux_loss = switch_load_balancing_loss_func(
            scores,
            tokens_per_expert,
            num_tokens * get_pg_size(self.seq_group),
            self.topk,
            self.num_experts,
            coeff,
        )
        return self._attach(probs, "load_balancing_loss", aux_loss, coeff)

    def apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if not coeff or not self.training or not torch.is_grad_enabled():
            return logits
        # Each part of a sequence contributes its share of the mean.
        z_loss = z_loss_func(logits, coeff / get_pg_size(self.seq_group))
        return self._attach(logits, "z_loss", z_loss, coeff)

    def routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, routing_map)`` [tokens, experts] from ``logits`` [tokens, experts]."""
        c = self.config
        logits = self.apply_z_loss(logits)
        probs, routing_map = topk_routing_with_score_function(
            logits,
            self.topk,
            use_pre_softmax=c.moe_router_pre_softmax,
            scaling_factor=c.moe_router_topk_scaling_factor,
            score_function=c.moe_router_score_function,
        )
        if c.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs,
                routing_map,
                self.topk,
                c.moe_expert_capacity_factor,
                drop_policy=c.moe_token_drop_policy,
                pad_to_capacity=c.moe_pad_expert_input_to_capacity,
            )
        if self.training and torch.is_grad_enabled():
            probs = self.apply_load_balancing_loss(logits, probs, logits.shape[0])
        return probs, routing_map

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input`` [s, b, h] (this rank's part of the sequence) -> ``(probs, routing_map)`` over its
        s x b tokens. Records the tokens each expert gets, for the dashboards."""
        logits = self.gating(input).view(-1, self.num_experts)
        probs, routing_map = self.routing(logits)
        # Once per microbatch: not again when a recomputed layer runs its forward in backward.
        if self.training and not (is_checkpointing() and torch.is_grad_enabled()):
            get_moe_metrics_tracker().record_tokens(
                routing_map.sum(dim=0), self.layer_number, self.config.num_layers
            )
        return probs, routing_map
