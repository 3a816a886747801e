"""GPT layer specs (megatron.core.models.gpt.gpt_layer_specs): ModuleSpecs naming the modules
megatron_lite builds, for upstream's ``TransformerLayer(config, submodules)``,
``TransformerBlock(config, spec)``, ``MoELayer(config, submodules)`` and ``GPTModel(config, spec, ...)``.

Only the local spec exists: Transformer Engine is not used by megatron_lite, so the TE spec refuses.
The norms follow ``config.normalization`` (LayerNorm or RMSNorm) whatever the spec names."""

from __future__ import annotations

from megatron_lite.core import parallel_state
from megatron_lite.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron_lite.core.transformer.dot_product_attention import DotProductAttention
from megatron_lite.core.transformer.enums import AttnMaskType
from megatron_lite.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron_lite.core.transformer.mlp import MLP, MLPSubmodules
from megatron_lite.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron_lite.core.transformer.moe.moe_layer import MoELayer, MoESubmodules, moe_layer_pattern
from megatron_lite.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron_lite.core.transformer.spec_utils import ModuleSpec
from megatron_lite.core.transformer.torch_norm import WrappedTorchNorm
from megatron_lite.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

_NO_TE = (
    "Transformer Engine is not available in megatron_lite: use get_gpt_layer_local_spec "
    "(use_transformer_engine=False), which builds the same layers from plain torch modules"
)


def _refuse_unsupported(multi_latent_attention, qk_l2_norm, use_kitchen, qk_layernorm=False) -> None:
    for wanted, what in (
        (multi_latent_attention, "multi-latent attention (MLA)"),
        (qk_l2_norm, "query / key L2 norms"),
        (qk_layernorm, "query / key layer norms (qk_layernorm)"),
        (use_kitchen, "kitchen (NVIDIA-internal) modules"),
    ):
        if wanted:
            raise NotImplementedError(f"{what} are not supported by megatron_lite")


def get_mlp_module_spec(
    use_te: bool | None = True,
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = False,
    fp8: str | None = None,
    use_te_op_fuser: bool | None = False,
) -> ModuleSpec:
    """The dense MLP's spec, or with ``num_experts`` the MoE layer's (grouped or sequential experts)."""
    if use_te or use_te_op_fuser:
        raise ValueError(_NO_TE)
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if num_experts is None:
        return ModuleSpec(module=MLP, submodules=linears)
    experts = (
        ModuleSpec(module=TEGroupedMLP)
        if moe_grouped_gemm
        else ModuleSpec(module=SequentialMLP, submodules=linears)
    )
    shared = ModuleSpec(module=SharedExpertMLP, submodules=linears)  # built when the config asks
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts, shared_experts=shared))


def get_gpt_layer_local_submodules(
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = False,
    qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False,
    fp8: str | None = None,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> TransformerLayerSubmodules:
    """A layer of megatron_lite's modules: norm, causal self-attention, norm, then a dense MLP or
    (``num_experts``) a MoE layer. ``normalization`` is for upstream's signature: the norm modules
    read ``config.normalization``."""
    _refuse_unsupported(multi_latent_attention, qk_l2_norm, use_kitchen, qk_layernorm)
    return TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear,
                core_attention=DotProductAttention,
                linear_proj=RowParallelLinear,
                q_layernorm=IdentityOp,
                k_layernorm=IdentityOp,
            ),
        ),
        self_attn_bda=IdentityFuncOp,
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=get_mlp_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm),
        mlp_bda=IdentityFuncOp,
    )


def get_gpt_layer_local_spec(*args, **kwargs) -> ModuleSpec:
    """``ModuleSpec(TransformerLayer, get_gpt_layer_local_submodules(...))``: with no arguments, a
    dense layer."""
    return ModuleSpec(module=TransformerLayer, submodules=get_gpt_layer_local_submodules(*args, **kwargs))


def get_gpt_layer_with_transformer_engine_submodules(*args, **kwargs) -> TransformerLayerSubmodules:
    """Refused: megatron_lite has no Transformer Engine."""
    raise ValueError(_NO_TE)


def get_gpt_layer_with_transformer_engine_spec(*args, **kwargs) -> ModuleSpec:
    """Refused: megatron_lite has no Transformer Engine."""
    raise ValueError(_NO_TE)


def get_gpt_decoder_layer_specs(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> list[ModuleSpec]:
    """Every layer's spec, MoE where ``config.moe_layer_freq`` puts a MoE layer, dense elsewhere."""
    if use_transformer_engine:
        raise ValueError(_NO_TE)
    if isinstance(config.moe_layer_freq, list) and len(config.moe_layer_freq) != config.num_layers:
        raise ValueError(
            f"Invalid length of moe_layer_pattern: {len(config.moe_layer_freq)}, expected {config.num_layers}"
        )
    common = dict(
        qk_layernorm=getattr(config, "qk_layernorm", False),
        multi_latent_attention=getattr(config, "multi_latent_attention", False),
        normalization=normalization,
        qk_l2_norm=qk_l2_norm,
    )
    dense = get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, **common)
    if not config.num_moe_experts:
        return [dense] * config.num_layers
    moe = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm, **common
    )
    return [moe if flag else dense for flag in moe_layer_pattern(config)]


def get_gpt_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """The layer specs of the layers this pipeline stage (``pp_rank``, model chunk ``vp_stage``;
    parallel_state's when None) builds, and the final norm."""
    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine, normalization, qk_l2_norm)
    if pp_rank is None and not parallel_state.is_initialized():
        pp_rank = 0  # a single process without groups: the one stage
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=WrappedTorchNorm)
