"""The transformer MLP: column-parallel fc1, the activation (gated for SwiGLU), row-parallel fc2."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_lite.core.fusions.fused_bias_swiglu import fuses, swiglu
from megatron_lite.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.core.transformer.transformer_config import TransformerConfig


@dataclass
class MLPSubmodules:
    """What a layer spec says an MLP is built of (upstream's names). megatron_lite's MLP always uses
    its column- and row-parallel linears; ``activation_func`` is the config's."""

    linear_fc1: object = None
    linear_fc2: object = None
    activation_func: object = None


class MLP(nn.Module):
    """``fc2(act(fc1(x)))``, or with ``gated_linear_unit`` ``fc2(act(gate) * value)`` where fc1 makes
    both ``ffn_hidden_size``-wide halves. Each TP rank's fc1 holds its slice of the gate followed by
    its slice of the value (upstream's per-rank layout; stride 2 cuts the full [gate; value] master
    that way), so the split into the two halves is local.

    Built with upstream's signature (``MLP(config, submodules, ...)``) it returns upstream's
    ``(output, bias)`` pair, the bias None (added inside); built by megatron_lite's layers without
    ``submodules`` it returns the output alone."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules | None = None,
        is_expert: bool = False,
        input_size: int | None = None,
        ffn_hidden_size=None,
        tp_group=None,
        *,
        init_method=None,
        output_layer_init_method=None,
    ):
        """``ffn_hidden_size``: None means the config's (a shared expert passes its own); the init
        methods None mean the config's."""
        super().__init__()
        if is_expert or (input_size is not None and input_size != config.hidden_size):
            raise NotImplementedError("megatron_lite's MLP is a dense hidden_size -> hidden_size MLP")
        init_method = init_method or config.init_method
        output_layer_init_method = output_layer_init_method or config.output_layer_init_method
        self.returns_bias = submodules is not None
        self.config = config
        self.activation_func = config.activation_func
        gated = config.gated_linear_unit
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            ffn_hidden_size * (2 if gated else 1),
            config=config,
            init_method=init_method,
            bias=config.add_bias_linear,
            stride=2 if gated else 1,
            tp_group=tp_group,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size,
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
        if fuses(self.config):  # SwiGLU saving only fc1's output, as megatron-core's fused function
            intermediate = swiglu(intermediate)
        elif self.config.gated_linear_unit:
            gate, value = intermediate.chunk(2, dim=-1)
            intermediate = self.activation_func(gate) * value
        else:
            intermediate = self.activation_func(intermediate)
        output, _ = self.linear_fc2(intermediate)
        return (output, None) if self.returns_bias else output
