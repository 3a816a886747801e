"""MoELayer (megatron.core.transformer.moe.moe_layer): route, dispatch, run the local experts,
combine, and add the shared expert. It stands where a dense layer has its MLP (``mlp``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_lite.core.process_group_utils import get_pg_rank, get_pg_size
from megatron_lite.core.tensor_parallel.random import checkpoint
from megatron_lite.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron_lite.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron_lite.core.transformer.moe.router import TopKRouter
from megatron_lite.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron_lite.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron_lite.core.transformer.spec_utils import spec_module
from megatron_lite.core.transformer.transformer_config import TransformerConfig


@dataclass
class MoESubmodules:
    """What a layer spec says a MoE layer is built of (upstream's fields): ``experts`` a spec of
    SequentialMLP or TEGroupedMLP; the router is megatron_lite's TopKRouter, the shared expert the
    config's (``moe_shared_expert_intermediate_size``)."""

    experts: object = None
    shared_experts: object = None
    router: object = TopKRouter


def _experts_class(config: TransformerConfig, submodules: MoESubmodules | None):
    if submodules is None or submodules.experts is None:
        return TEGroupedMLP if config.moe_grouped_gemm else SequentialMLP
    cls = spec_module(submodules.experts)
    if not (isinstance(cls, type) and issubclass(cls, (SequentialMLP, TEGroupedMLP))):
        raise NotImplementedError(f"experts {cls!r}: megatron_lite builds SequentialMLP or TEGroupedMLP")
    return cls


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
    context parallelism, the group splitting the sequence) in forward and backward.

    Built with upstream's signature (``MoELayer(config, submodules)``, groups parallel_state's when
    ``pg_collection`` is None) it returns upstream's ``(output, bias)`` pair, the bias None; built by
    megatron_lite's layers without ``submodules`` it returns the output alone."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MoESubmodules | None = None,
        layer_number: int | None = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: str | None = None,
        *,
        seed: int = 1234,
        init_method=None,
        output_layer_init_method=None,
    ):
        super().__init__()
        if is_mtp_layer:
            raise NotImplementedError("multi-token prediction is not supported by megatron_lite")
        if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            raise ValueError(f"Unsupported token dispatcher type: {config.moe_token_dispatcher_type}")
        self.submodules = submodules
        self.returns_bias = submodules is not None
        pg_collection = pg_collection or get_default_pg_collection()
        init_method = init_method or config.init_method
        output_layer_init_method = output_layer_init_method or config.output_layer_init_method
        self.config = config
        self.layer_number = layer_number
        layer_number = layer_number or 1  # the key the experts' weights are drawn from
        # Selective recomputation of the whole MoE layer (upstream's "moe" module).
        self.moe_layer_recompute = config.recompute_granularity == "selective" and "moe" in (
            config.recompute_modules or []
        )
        ep_rank, ep_size = get_pg_rank(pg_collection.ep), get_pg_size(pg_collection.ep)
        self.num_local_experts = config.num_moe_experts // ep_size
        offset = ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(offset, offset + self.num_local_experts))
        seq_group = pg_collection.tp_cp if config.sequence_parallel else pg_collection.cp
        self.router = TopKRouter(config, pg_collection, layer_number=layer_number, seq_group=seq_group)
        experts = _experts_class(config, submodules)
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

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def _forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        probs, routing_map = self.router(hidden_states, padding_mask)
        tokens, tokens_per_expert, token_probs = self.token_dispatcher.token_permutation(
            hidden_states, probs, routing_map
        )
        expert_output = self.experts(tokens, tokens_per_expert, token_probs)
        output = self.token_dispatcher.token_unpermutation(expert_output)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output

    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """``hidden_states`` [s, b, h]; ``padding_mask`` [b, s] (upstream's layout), True at padding:
        those tokens are routed but count in no auxiliary loss or expert-bias count."""
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        if self.moe_layer_recompute and self.training:
            output = checkpoint(self._forward, False, hidden_states, padding_mask)
        else:
            output = self._forward(hidden_states, padding_mask)
        return (output, None) if self.returns_bias else output
