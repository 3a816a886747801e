"""TransformerConfig: the model's shape, parallel layout and numerics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F

from megatron_lite.core.model_parallel_config import ModelParallelConfig
from megatron_lite.core.transformer.pipeline_layer_split import pipeline_layer_counts
from megatron_lite.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron_lite.core.utils import init_method_normal, scaled_init_method_normal


class _DefaultInit:
    """An initialiser field that, left unset (None), is normal(0, init_method_std), scaled by
    1 / sqrt(2 num_layers) for output projections: derived when read, so it follows later changes
    of ``init_method_std`` / ``num_layers`` (the CLI sets them after construction)."""

    def __init__(self, scaled: bool):
        self.scaled = scaled

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}_explicit"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return None  # the dataclass default
        explicit = obj.__dict__.get(self.slot)
        if explicit is not None:
            return explicit
        if self.scaled:
            return scaled_init_method_normal(obj.init_method_std, obj.num_layers)
        return init_method_normal(obj.init_method_std)

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


@dataclass(kw_only=True)
class TransformerConfig(ModelParallelConfig):
    """Dimensions and numerics shared by every transformer module; the parallel layout and precision
    fields come from ModelParallelConfig, as upstream."""

    num_layers: int = 8
    """Number of transformer layers across all pipeline stages."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Transformer layers on the first pipeline stage; None means an even split."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Transformer layers on the last pipeline stage; None means an even split."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting layers over pipeline stages."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one layer when splitting layers over pipeline stages."""
    pipeline_model_parallel_layout: str | list | PipelineParallelLayerLayout | None = None
    """Every (virtual) pipeline stage's layers in layer order, e.g. ``"Ett|(tt|)*2,tL"`` (see
    PipelineParallelLayerLayout); sets the virtual pipeline size. None: the split above."""
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
    num_query_groups: int | None = None
    """Key/value head groups (grouped-query attention); None means one group per head."""
    normalization: str = "LayerNorm"
    """Normalization layer: ``LayerNorm`` or ``RMSNorm``."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the normalization layers (LayerNorm or RMSNorm)."""
    gated_linear_unit: bool = False
    """Gated MLP: fc1 produces a gate and a value half, ``act(gate) * value`` feeds fc2 (SwiGLU with silu)."""
    activation_func: Callable = F.gelu
    """The MLP's activation (of the gate, for gated MLPs)."""
    rotary_interleaved: bool = False
    """Rotate adjacent channel pairs instead of the two halves of each head (rotary embeddings)."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before each residual add."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (per-TP-rank RNG stream)."""
    add_bias_linear: bool = True
    """Biases on linear layers."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection even when ``add_bias_linear`` is off (Qwen-style)."""
    recompute_granularity: str | None = None
    """Activation recomputation: ``full`` (whole layers, see ``recompute_method``), ``selective``
    (the modules in ``recompute_modules``) or None."""
    recompute_method: str | None = None
    """With full recomputation: ``uniform`` (chunks of ``recompute_num_layers`` layers, only each
    chunk's input kept) or ``block`` (the first ``recompute_num_layers`` layers of each stage)."""
    recompute_num_layers: int | None = None
    """Layers per recomputed chunk (uniform) or recomputed layers per stage (block)."""
    recompute_modules: list[str] | None = None
    """Modules recomputed by selective recomputation: ``core_attn`` and/or ``mlp``; None means core_attn."""
    distribute_saved_activations: bool = False
    """Keep each recomputed chunk's input split over the tensor-parallel ranks (full recompute only)."""
    init_method: Callable | None = _DefaultInit(scaled=False)
    """Initialiser of the weights feeding no residual; None means normal(0, init_method_std)."""
    output_layer_init_method: Callable | None = _DefaultInit(scaled=True)
    """Initialiser of the output projections; None means normal(0, init_method_std / sqrt(2 num_layers))."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None and self.num_attention_heads > 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        if isinstance(self.pipeline_model_parallel_layout, (str, list)):
            # As upstream: parsed here, the virtual pipeline size taken from it, the split checked.
            layout = PipelineParallelLayerLayout(
                self.pipeline_model_parallel_layout, self.pipeline_model_parallel_size
            )
            self.pipeline_model_parallel_layout = layout
            vp = layout.virtual_pipeline_model_parallel_size
            if self.virtual_pipeline_model_parallel_size is None and vp > 1:
                self.virtual_pipeline_model_parallel_size = vp
            pipeline_layer_counts(self)
