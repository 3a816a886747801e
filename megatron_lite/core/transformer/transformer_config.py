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
        self.slot, self.derived = f"_{name}_explicit", f"_{name}_derived"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return None  # the dataclass default
        explicit = obj.__dict__.get(self.slot)
        if explicit is not None:
            return explicit
        # One initialiser per (std, layers), so a config equals itself as upstream's does.
        key = (obj.init_method_std, obj.num_layers if self.scaled else None)
        cached = obj.__dict__.get(self.derived)
        if cached is None or cached[0] != key:
            init = scaled_init_method_normal(*key) if self.scaled else init_method_normal(key[0])
            cached = obj.__dict__[self.derived] = (key, init)
        return cached[1]

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
    # Mixture of experts (upstream's fields; see core/transformer/moe/).
    num_moe_experts: int | None = None
    """Experts per MoE layer; None means a dense model."""
    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE: every n-th (n an int, layer 0 first) or a 0/1 flag per layer."""
    moe_ffn_hidden_size: int | None = None
    """Each routed expert's MLP hidden size; None means ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Hidden size of the shared expert (all shared experts as one MLP); None means none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . gate_weight) (Qwen2-MoE)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``aux_loss`` (Switch Transformer's, over each micro-batch) or ``none``."""
    moe_aux_loss_coeff: float = 0.0
    """Scale of the load-balancing loss; 0 turns it off."""
    moe_z_loss_coeff: float | None = None
    """Scale of the router z-loss (ST-MoE); None turns it off."""
    moe_router_score_function: str = "softmax"
    """Router scores: ``softmax`` or ``sigmoid``."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (else over the top-k logits only)."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiply the top-k routing probabilities by this; None means 1."""
    moe_token_dispatcher_type: str = "allgather"
    """How tokens reach their experts: ``allgather`` or ``alltoall`` over the expert-parallel group."""
    moe_grouped_gemm: bool = False
    """All local experts in one grouped GEMM (``experts.linear_fc1.weight<i>``); else one MLP per
    expert (``experts.local_experts.<i>``)."""
    moe_expert_capacity_factor: float | None = None
    """Tokens an expert takes at most, as a multiple of its balanced share; None means no dropping."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (needs a capacity factor)."""
    moe_token_drop_policy: str = "probs"
    """Over capacity, keep the tokens with the highest ``probs`` or the earliest ``position``."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias (``expert_bias``) added to the scores that choose
    the experts (sigmoid / sqrtsoftplus), updated from the routed-token counts."""
    moe_router_bias_update_rate: float = 1e-3
    """How far each expert bias moves per update (aux-loss-free balancing)."""
    moe_router_dtype: str | None = None
    """The router's logits and probabilities in ``fp32`` or ``fp64``; None means the input's dtype."""
    moe_router_force_load_balancing: bool = False
    """Route on random logits (a load-balanced benchmark), gradients passed straight through."""
    moe_router_num_groups: int | None = None
    """Expert groups for group-limited routing (e.g. the expert-parallel size); None for none."""
    moe_router_group_topk: int | None = None
    """Groups each token may use under group-limited routing."""
    moe_router_fusion: bool = False
    """Transformer Engine's fused routing kernels (not supported: False)."""
    moe_input_jitter_eps: float | None = None
    """Multiply the router's input by uniform noise in [1 - eps, 1 + eps]; None for none."""
    fp8: str | None = None
    """FP8 training (Transformer Engine; not supported: None)."""
    bias_activation_fusion: bool = False
    """Fuse the MLP's bias add into its activation (the result is the same unfused)."""
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
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
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
