"""Llama (2, 3, 3.1's rope scaling): RMSNorm, SwiGLU, grouped-query attention, rotary positions."""

from __future__ import annotations

import torch.nn.functional as F

from megatron_lite.bridge.models.conversion.hf_config import HFConfig
from megatron_lite.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron_lite.bridge.models.conversion.model_bridge import (
    MegatronModelBridge,
    make_vocab_size_divisible_by,
)
from megatron_lite.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping, QKVMapping

# transformers' LlamaConfig defaults, for keys a config.json leaves out.
LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
}
# megatron-core's Llama 3 scaling has these fixed (RotaryEmbedding._apply_scaling).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rotary_base(theta: float):
    return int(theta) if float(theta).is_integer() else theta


def rope_kwargs(cfg: HFConfig) -> dict:
    """Rotary base and scaling: none, linear (position interpolation) or Llama 3's frequency scaling."""
    kwargs = {"position_embedding_type": "rope", "rotary_base": _rotary_base(cfg["rope_theta"])}
    scaling = cfg.get("rope_scaling")
    if not scaling:
        return kwargs
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return kwargs
    if kind == "linear":
        return {**kwargs, "seq_len_interpolation_factor": float(scaling["factor"])}
    if kind == "llama3":
        for key, value in _LLAMA3_FIXED.items():
            if float(scaling.get(key, value)) != value:
                raise cfg.refuse(
                    "rope_scaling",
                    f"llama3 scaling with {key}={scaling.get(key)} (megatron-core fixes {value})",
                )
        return {**kwargs, "rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}
    raise cfg.refuse("rope_scaling", f"rope type {kind!r} is not supported (default, linear and llama3 are)")


def llama_like_kwargs(cfg: HFConfig) -> dict:
    """A Llama-shaped decoder's GPTModelProvider fields."""
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise cfg.refuse("partial_rotary_factor", "a Llama-shaped model rotates every channel of a head")
    if cfg["hidden_act"] not in ("silu", "swish"):
        raise cfg.refuse("hidden_act", "megatron_lite's gated MLP uses silu")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    vocab = cfg["vocab_size"]
    return dict(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads", heads),
        kv_channels=cfg.get("head_dim", hidden // heads),
        ffn_hidden_size=cfg["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg["rms_norm_eps"]),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        vocab_size=vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by(vocab),
        seq_length=cfg["max_position_embeddings"],
        max_position_embeddings=cfg["max_position_embeddings"],
        share_embeddings_and_output_weights=bool(cfg["tie_word_embeddings"]),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        **rope_kwargs(cfg),
    )


def llama_like_registry(config, qkv_bias: bool = False) -> MegatronMappingRegistry:
    layer, hf = "decoder.layers.*.", "model.layers.*."
    output = "model.embed_tokens.weight" if config.share_embeddings_and_output_weights else "lm_head.weight"
    mappings = [
        AutoMapping("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        AutoMapping("output_layer.weight", output),
        AutoMapping("decoder.final_layernorm.weight", "model.norm.weight"),
        AutoMapping(layer + "input_layernorm.weight", hf + "input_layernorm.weight"),
        AutoMapping(layer + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
        AutoMapping(layer + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight"),
        AutoMapping(layer + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight"),
        QKVMapping(
            layer + "self_attention.linear_qkv.weight", *(hf + f"self_attn.{p}_proj.weight" for p in "qkv")
        ),
        GatedMLPMapping(
            layer + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"
        ),
    ]
    if qkv_bias:
        mappings.append(
            QKVMapping(
                layer + "self_attention.linear_qkv.bias", *(hf + f"self_attn.{p}_proj.bias" for p in "qkv")
            )
        )
    return MegatronMappingRegistry(*mappings)


@MegatronModelBridge.register_bridge("llama")
class LlamaBridge(MegatronModelBridge):
    """``LlamaForCausalLM``."""

    def provider_kwargs(self, hf: dict) -> dict:
        cfg = HFConfig(hf, LLAMA_DEFAULTS)
        if cfg["attention_bias"] or cfg["mlp_bias"]:
            key = "attention_bias" if cfg["attention_bias"] else "mlp_bias"
            raise cfg.refuse(key, "Llama with biases is not supported (Qwen2's query-key-value bias is)")
        return llama_like_kwargs(cfg)

    def mapping_registry(self, config) -> MegatronMappingRegistry:
        return llama_like_registry(config)
