"""Llama (2, 3, 3.1's rope scaling): RMSNorm, SwiGLU, grouped-query attention, rotary positions. The
Llama-shaped families (Mistral, Qwen2, Mixtral, Qwen2-MoE) subclass LlamaBridge."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_lite.bridge.models.conversion.hf_config import HFConfig
from megatron_lite.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron_lite.bridge.models.conversion.model_bridge import MegatronModelBridge, WeightConversionTask
from megatron_lite.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping, QKVMapping
from megatron_lite.core.models.gpt.gpt_model import GPTModel

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
_ROPE_TYPES = (None, "default", "linear", "llama3")


def _rope_type(scaling) -> str | None:
    return (scaling.get("type") or scaling.get("rope_type")) if scaling else None


def check_llama_like(cfg: HFConfig) -> None:
    """Refuse what a Llama-shaped megatron_lite model cannot be: a partial rotation, another activation,
    a rope scaling other than none, linear and Llama 3's (with megatron-core's fixed frequencies)."""
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise cfg.refuse("partial_rotary_factor", "a Llama-shaped model rotates every channel of a head")
    if cfg["hidden_act"] not in ("silu", "swish"):
        raise cfg.refuse("hidden_act", "megatron_lite's gated MLP uses silu")
    scaling = cfg.get("rope_scaling")
    kind = _rope_type(scaling)
    if kind not in _ROPE_TYPES:
        raise cfg.refuse(
            "rope_scaling", f"rope type {kind!r} is not supported (default, linear and llama3 are)"
        )
    if kind == "linear":
        float(scaling["factor"])  # a linear scaling without its factor is refused (KeyError)
    if kind == "llama3":
        for key, value in _LLAMA3_FIXED.items():
            if float(scaling.get(key, value)) != value:
                raise cfg.refuse(
                    "rope_scaling",
                    f"llama3 scaling with {key}={scaling.get(key)} (megatron-core fixes {value})",
                )


def llama_like_kwargs(cfg: HFConfig) -> dict:
    """The fields every Llama-shaped model sets beyond CONFIG_MAPPING's (Megatron-Bridge's values)."""
    kwargs = dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        hidden_dropout=0.0,
        bias_activation_fusion=True,
        masked_softmax_fusion=True,
        persist_layer_norm=True,
        bias_dropout_fusion=True,
        apply_rope_fusion=True,
        rotary_percent=1.0,
        position_embedding_type="rope",
        rope_scaling=False,
        rope_scaling_factor=1.0,
        max_position_embeddings=cfg.get("max_position_embeddings"),
    )
    if cfg.get("num_key_value_heads") is None:  # transformers' default: one key-value head per head
        kwargs["num_query_groups"] = cfg.get("num_attention_heads")
    scaling = cfg.get("rope_scaling")
    kind = _rope_type(scaling)
    if kind == "llama3":
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(scaling.get("factor", 8.0)))
    elif kind == "linear":
        kwargs["seq_len_interpolation_factor"] = float(scaling["factor"])
    return kwargs


def llama_like_registry(qkv_bias: bool = False, *extra) -> MegatronMappingRegistry:
    """A Llama-shaped model's mappings (the output layer is ``lm_head``; a tied one is the embedding's,
    which the bridge's streams handle), with ``extra`` mappings after them."""
    layer, hf = "decoder.layers.*.", "model.layers.*."
    mappings = [
        AutoMapping("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        AutoMapping("output_layer.weight", "lm_head.weight"),
        AutoMapping("decoder.final_layernorm.weight", "model.norm.weight"),
        AutoMapping(layer + "self_attention.linear_qkv.layer_norm_weight", hf + "input_layernorm.weight"),
        AutoMapping(layer + "input_layernorm.weight", hf + "input_layernorm.weight"),
        AutoMapping(layer + "mlp.linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight"),
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
    return MegatronMappingRegistry(*mappings, *extra)


@MegatronModelBridge.register_bridge(source="LlamaForCausalLM", target=GPTModel, model_type="llama")
class LlamaBridge(MegatronModelBridge):
    """``LlamaForCausalLM``."""

    hf_config_defaults = LLAMA_DEFAULTS

    def check_hf_config(self, cfg: HFConfig) -> None:
        check_llama_like(cfg)
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise cfg.refuse(key, "Llama with biases is not supported (Qwen2's query-key-value bias is)")

    def hf_config_to_model_config_kwargs(self, hf_config) -> dict:
        kwargs = super().hf_config_to_model_config_kwargs(hf_config)
        kwargs.update(llama_like_kwargs(HFConfig(hf_config, self.hf_config_defaults)))
        return kwargs

    def hf_config_to_provider_kwargs(self, hf_config) -> dict:
        """The provider takes the model config's fields (one mapping for both)."""
        return self.hf_config_to_model_config_kwargs(hf_config)

    @classmethod
    def megatron_to_hf_config(cls, provider) -> dict:
        hf_config = super().megatron_to_hf_config(provider)
        if provider.rope_scaling:
            hf_config["rope_scaling"] = {"rope_type": "llama3", "factor": provider.rope_scaling_factor}
            hf_config["rope_scaling"].update(_LLAMA3_FIXED)
        elif provider.seq_len_interpolation_factor is not None:
            hf_config["rope_scaling"] = {
                "rope_type": "linear",
                "factor": provider.seq_len_interpolation_factor,
            }
        return hf_config

    def mapping_registry(self) -> MegatronMappingRegistry:
        return llama_like_registry()

    def maybe_modify_converted_hf_weight(
        self,
        task: WeightConversionTask,
        converted_weights_dict: dict[str, torch.Tensor],
        hf_state_dict: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Llama 2 files hold each layer's rotary ``inv_freq`` buffer: exported with the layer's input
        norm, copied from the source, where the source has it."""
        norm = next(
            (
                n
                for n in converted_weights_dict
                if n.startswith("model.layers.") and n.endswith(".input_layernorm.weight")
            ),
            None,
        )
        if norm is None or not norm.split(".")[2].isdigit():
            return converted_weights_dict
        key = f"model.layers.{norm.split('.')[2]}.self_attn.rotary_emb.inv_freq"
        if key in converted_weights_dict or key not in hf_state_dict:
            return converted_weights_dict
        inv_freq = hf_state_dict[key]
        return {**converted_weights_dict, key: inv_freq.to(converted_weights_dict[norm].device)}
