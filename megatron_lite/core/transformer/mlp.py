"""The transformer MLP: column-parallel fc1, GELU, row-parallel fc2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.core.transformer.transformer_config import TransformerConfig


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig, *, init_method, output_layer_init_method, tp_group=None):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            config.ffn_hidden_size,
            config=config,
            init_method=init_method,
            bias=config.add_bias_linear,
            tp_group=tp_group,
        )
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.linear_fc1(hidden_states)
        output, _ = self.linear_fc2(F.gelu(intermediate))
        return output
