"""Router / TopKRouter (megatron.core.transformer.moe.router): scores every expert for every token
and picks each token's top-k (or Sinkhorn-balanced) experts, with the load-balancing and z losses
attached to the backward pass and, aux-loss-free, a per-expert bias that steers the choice."""

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
    get_default_pg_collection,
    switch_load_balancing_loss_func,
    z_loss_func,
)
from megatron_lite.core.transformer.moe.routing import (
    apply_random_logits,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    router_gating_linear,
    sinkhorn,
    topk_routing_with_score_function,
)
from megatron_lite.core.transformer.transformer_config import TransformerConfig

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}
_GROUP_FROM_COLLECTION = object()  # seq_group not given: derived from the process groups


class Router(nn.Module):
    """``weight`` [experts, hidden], alike on every tensor-parallel rank. ``seq_group``: the ranks
    holding parts of the same sequences (tensor-parallel ranks under sequence parallelism, context-
    parallel ranks); the load-balancing loss counts tokens over all of them, as upstream's tp_cp group.
    Left out, it comes from ``pg_collection`` (parallel_state's groups when that is None too)."""

    def __init__(
        self,
        config: TransformerConfig,
        pg_collection=None,
        is_mtp_layer: bool = False,
        *,
        layer_number: int | None = None,
        seq_group=_GROUP_FROM_COLLECTION,
    ):
        super().__init__()
        if is_mtp_layer:
            raise NotImplementedError("multi-token prediction is not supported by megatron_lite")
        if seq_group is _GROUP_FROM_COLLECTION:
            pg = pg_collection or get_default_pg_collection()
            seq_group = pg.tp_cp if config.sequence_parallel else pg.cp
        self.config = config
        self.layer_number = layer_number
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

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Logits in the input's dtype, or in ``moe_router_dtype`` (fp32 / fp64) when set."""
        router_dtype = _ROUTER_DTYPES[self.config.moe_router_dtype]
        if router_dtype is None:
            return F.linear(input, self.weight.to(input.dtype))
        return router_gating_linear(input, self.weight, None, router_dtype)


class TopKRouter(Router):
    """Routes each token to its top-k experts (``moe_router_load_balancing_type``: ``aux_loss``,
    ``sinkhorn`` or ``none``). With ``moe_router_enable_expert_bias`` it keeps ``expert_bias`` and
    ``local_tokens_per_expert`` (the routed tokens counted since the last bias update), float32."""

    def __init__(self, config: TransformerConfig, pg_collection=None, is_mtp_layer: bool = False, **kwargs):
        super().__init__(config, pg_collection, is_mtp_layer, **kwargs)
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        if self.enable_expert_bias:
            zeros = torch.zeros(self.num_experts, dtype=torch.float32)
            self.register_buffer("local_tokens_per_expert", zeros.clone(), persistent=False)
            self.register_buffer("expert_bias", zeros.clone())
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None

    @property
    def score_function(self) -> str:
        return self.config.moe_router_score_function

    def _attach(self, activation: torch.Tensor, name: str, loss: torch.Tensor, coeff: float) -> torch.Tensor:
        """Train ``loss`` through ``activation``'s backward; record ``loss / coeff`` for the logs."""
        get_moe_metrics_tracker().record(name, loss / coeff, self.layer_number or 1, self.config.num_layers)
        return MoEAuxLossAutoScaler.apply(activation, loss)

    def apply_load_balancing_loss(self, logits, probs, num_tokens: int, padding_mask=None):
        coeff = self.config.moe_aux_loss_coeff
        if self.routing_type != "aux_loss" or not coeff:
            return probs
        routing_map, scores = compute_routing_scores_for_aux_loss(
            logits, self.topk, self.score_function, padding_mask=padding_mask
        )
        # Counted over the whole sequence (a collective over seq_group); each rank's probs are its part.
        tokens_per_expert = routing_map.sum(dim=0)
        if get_pg_size(self.seq_group) > 1:
            dist.all_reduce(tokens_per_expert, group=self.seq_group)
        total = num_tokens * get_pg_size(self.seq_group)
        if padding_mask is not None:  # only the real tokens count
            total = tokens_per_expert.sum() / self.topk
        aux_loss = switch_load_balancing_loss_func(
            scores, tokens_per_expert, total, self.topk, self.num_experts, coeff
        )
        return self._attach(probs, "load_balancing_loss", aux_loss, coeff)

    def apply_z_loss(self, logits: torch.Tensor, padding_mask=None) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if not coeff or not self.training or not torch.is_grad_enabled():
            return logits
        # Each part of a sequence contributes its share of the mean.
        z_loss = z_loss_func(logits, coeff / get_pg_size(self.seq_group), padding_mask=padding_mask)
        return self._attach(logits, "z_loss", z_loss, coeff)

    def sinkhorn_load_balancing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts chosen on Sinkhorn-balanced scores while training (greedy in eval); the weights
        are the sigmoid (top-1) or softmax of the logits."""
        if self.config.moe_aux_loss_coeff:
            raise ValueError("Sinkhorn routing does not support aux loss.")

        def activation(x):
            return (
                torch.sigmoid(x)
                if self.topk == 1
                else torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)
            )

        if self.training:
            with torch.no_grad():
                _, indices = torch.topk(sinkhorn(logits.float()), k=self.topk, dim=1)
            logits = activation(logits)
        else:
            logits = activation(logits)
            _, indices = torch.topk(logits, k=self.topk, dim=1)
        routing_map = torch.zeros_like(logits, dtype=torch.int).scatter(1, indices, 1).bool()
        return logits * routing_map, routing_map

    def routing(self, logits: torch.Tensor, padding_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, routing_map)`` [tokens, experts] from ``logits`` [tokens, experts];
        ``padding_mask`` [tokens], True at padding."""
        c = self.config
        logits = self.apply_z_loss(logits, padding_mask)
        if self.routing_type == "sinkhorn":
            probs, routing_map = self.sinkhorn_load_balancing(logits)
        else:
            probs, routing_map = topk_routing_with_score_function(
                logits,
                self.topk,
                use_pre_softmax=c.moe_router_pre_softmax,
                num_groups=c.moe_router_num_groups,
                group_topk=c.moe_router_group_topk,
                scaling_factor=c.moe_router_topk_scaling_factor,
                score_function=c.moe_router_score_function,
                expert_bias=self.expert_bias,
                fused=c.moe_router_fusion,
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
            probs = self.apply_load_balancing_loss(logits, probs, logits.shape[0], padding_mask)
        if self.enable_expert_bias and torch.is_grad_enabled():
            # Counted once per forward with a graph: not in evaluation, not when recomputing.
            with torch.no_grad():
                counted = routing_map if padding_mask is None else routing_map & ~padding_mask.unsqueeze(-1)
                self.local_tokens_per_expert += counted.sum(dim=0)
        return probs, routing_map

    def forward(self, input: torch.Tensor, padding_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``input`` [s, b, h] (this rank's part of the sequence) -> ``(probs, routing_map)`` over its
        s x b tokens; ``padding_mask`` [s, b], True at padding. Records the tokens each expert gets,
        for the dashboards."""
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.float()  # a bf16 model cast it: routing needs fp32
        if self.config.moe_input_jitter_eps is not None:
            eps = self.config.moe_input_jitter_eps
            input = input * torch.empty_like(input).uniform_(1.0 - eps, 1.0 + eps)
        logits = self.gating(input).view(-1, self.num_experts)
        if self.config.moe_router_force_load_balancing:
            logits = apply_random_logits(logits)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        probs, routing_map = self.routing(logits, padding_mask)
        # Once per microbatch: not again when a recomputed layer runs its forward in backward.
        if self.training and not (is_checkpointing() and torch.is_grad_enabled()):
            get_moe_metrics_tracker().record_tokens(
                routing_map.sum(dim=0), self.layer_number or 1, self.config.num_layers
            )
        return probs, routing_map
