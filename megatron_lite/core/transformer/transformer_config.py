"""TransformerConfig: the model's shape, parallel layout and numerics."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class TransformerConfig:
    """Dimensions, parallel sizes and numerics shared by every transformer module."""

    num_layers: int = 8
    """Number of transformer layers across all pipeline stages."""
    hidden_size: int = 256
    """Transformer hidden size."""
    num_attention_heads: int = 8
    """Number of attention heads."""
    ffn_hidden_size: int | None = None
    """MLP hidden size; None means 4 x hidden_size."""
    kv_channels: int | None = None
    """Projection size per head; None means hidden_size / num_attention_heads."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation; output projections use std / sqrt(2 num_layers)."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before each residual add."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (per-TP-rank RNG stream)."""
    add_bias_linear: bool = True
    """Biases on linear layers."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved pipeline chunks per stage (not supported yet)."""
    context_parallel_size: int = 1
    """Context-parallel size."""
    sequence_parallel: bool = False
    """Sequence parallelism (not supported yet)."""
    bf16: bool = False
    """bf16 compute with fp32 master weights."""
    fp16: bool = False
    """fp16 compute (not supported yet)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None and self.num_attention_heads > 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads

    @property
    def params_dtype(self) -> torch.dtype:
        """dtype of the model's parameters and activations."""
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def pipeline_dtype(self) -> torch.dtype:
        """dtype of tensors sent between pipeline stages."""
        return self.params_dtype
