"""SharedExpertMLP (megatron.core.transformer.moe.shared_experts): an MLP every token goes through
besides its routed experts, tensor-parallel like the dense MLP, optionally gated per token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.tensor_parallel.utils import init_partition_
from megatron_lite.core.transformer.mlp import MLP


class SharedExpertMLP(MLP):
    """``linear_fc1`` / ``linear_fc2`` of ``moe_shared_expert_intermediate_size``; with
    ``moe_shared_expert_gate`` the output is scaled by ``sigmoid(x . gate_weight)`` (Qwen2-MoE)."""

    def __init__(self, config, *, init_method, output_layer_init_method, tp_group=None):
        super().__init__(
            config,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            tp_group=tp_group,
            ffn_hidden_size=config.moe_shared_expert_intermediate_size,
        )
        self.use_shared_expert_gate = config.moe_shared_expert_gate
        if self.use_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty((1, config.hidden_size), dtype=config.params_dtype))
            if config.perform_initialization:
                init_partition_(self.gate_weight, init_method, None, 0, 1)
            # Each sequence-parallel rank gates its own tokens: the gradients add up over TP.
            self.gate_weight.sequence_parallel = config.sequence_parallel
            self.gate_weight.allreduce = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = super().forward(hidden_states)
        if self.use_shared_expert_gate:
            gate = torch.sigmoid(F.linear(hidden_states, self.gate_weight.to(hidden_states.dtype)))
            output = output * gate
        return output
