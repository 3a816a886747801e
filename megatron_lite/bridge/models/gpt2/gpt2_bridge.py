"""GPT-2: learned positions, LayerNorm, a GELU MLP, biases everywhere, tied embeddings. Its linear
layers are ``Conv1D`` ([in, out], the transpose of ours) and ``c_attn`` holds all queries, then all
keys, then all values."""

from __future__ import annotations

import torch

from megatron_lite.bridge.models.conversion.hf_config import HFConfig
from megatron_lite.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron_lite.bridge.models.conversion.model_bridge import (
    MegatronModelBridge,
    make_vocab_size_divisible_by,
)
from megatron_lite.bridge.models.conversion.param_mapping import AutoMapping, MegatronParamMapping
from megatron_lite.bridge.models.conversion.param_mapping_base import _tp_range
from megatron_lite.core.models.gpt.gpt_model import GPTModel

GPT2_DEFAULTS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_inner": None,
    "activation_function": "gelu_new",
    "resid_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "tie_word_embeddings": True,
}


class GPT2QKVMapping(MegatronParamMapping):
    """``linear_qkv`` (per head: its query, key, value rows) from ``c_attn`` ([q | k | v] columns)."""

    def __init__(self, megatron_param: str, qkv: str):
        super().__init__(megatron_param, qkv)

    def read_shard(self, read, shape, tp_rank, tp_size, config):
        heads, d, hidden = config.num_attention_heads, config.kv_channels, config.hidden_size
        first, last = _tp_range(heads, tp_rank, tp_size)
        n, is_weight = last - first, len(shape) == 2
        parts = [
            read(self.hf_param, 1 if is_weight else 0, i * hidden + first * d, i * hidden + last * d)
            for i in range(3)
        ]
        if is_weight:
            parts = [p.t().reshape(n, d, -1) for p in parts]  # Conv1D [in, out] -> [out, in]
        else:
            parts = [p.reshape(n, d) for p in parts]
        return torch.stack(parts, dim=1).reshape(n * 3 * d, *shape[1:])

    def full_to_hf(self, full, config):
        heads, d = config.num_attention_heads, config.kv_channels
        rest = full.shape[1:]
        qkv = full.reshape(heads, 3, d, *rest).transpose(0, 1).reshape(3 * heads * d, *rest)
        return {self.hf_param: (qkv.t() if full.dim() == 2 else qkv).contiguous()}


@MegatronModelBridge.register_bridge(source="GPT2LMHeadModel", target=GPTModel, model_type="gpt2")
class GPT2Bridge(MegatronModelBridge):
    """``GPT2LMHeadModel``. Its config names its fields its own way (``n_embd``, ``n_layer``): the
    provider's fields are read here, not through CONFIG_MAPPING."""

    hf_config_defaults = GPT2_DEFAULTS
    optional_hf_prefix = "transformer."  # the hub's gpt2 files name tensors without it
    ignored_hf_suffixes = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers older files hold
    LORA_FAN_IN_FAN_OUT = True  # its Conv1D layers store [in, out]: PEFT's adapter config says so

    def check_hf_config(self, cfg: HFConfig) -> None:
        if cfg["activation_function"] not in ("gelu_new", "gelu"):
            raise cfg.refuse("activation_function", "megatron_lite takes gelu_new (--openai-gelu) or gelu")
        if cfg["scale_attn_by_inverse_layer_idx"] or not cfg["scale_attn_weights"]:
            key = "scale_attn_weights" if not cfg["scale_attn_weights"] else "scale_attn_by_inverse_layer_idx"
            raise cfg.refuse(key, "megatron_lite scales attention scores by 1/sqrt(head dim) only")

    def hf_config_to_provider_kwargs(self, hf_config) -> dict:
        cfg = HFConfig(hf_config, self.hf_config_defaults)
        activation_func = self.hf_to_megatron_activation(cfg["activation_function"])
        hidden, heads, vocab = cfg["n_embd"], cfg["n_head"], cfg["vocab_size"]
        return dict(
            num_layers=cfg["n_layer"],
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=heads,
            kv_channels=hidden // heads,
            ffn_hidden_size=cfg.get("n_inner", 4 * hidden),
            normalization="LayerNorm",
            layernorm_epsilon=float(cfg["layer_norm_epsilon"]),
            activation_func=activation_func,
            add_bias_linear=True,
            hidden_dropout=float(cfg["resid_pdrop"]),
            attention_dropout=float(cfg["attn_pdrop"]),
            position_embedding_type="learned_absolute",
            vocab_size=vocab,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by(vocab),
            seq_length=cfg["n_positions"],
            max_position_embeddings=cfg["n_positions"],
            share_embeddings_and_output_weights=bool(cfg["tie_word_embeddings"]),
            init_method_std=float(cfg["initializer_range"]),
        )

    def mapping_registry(self) -> MegatronMappingRegistry:
        layer, hf = "decoder.layers.*.", "transformer.h.*."
        output = "lm_head.weight"  # a tied one is the embedding's: the bridge's streams handle it
        mappings = [
            AutoMapping("embedding.word_embeddings.weight", "transformer.wte.weight"),
            AutoMapping("embedding.position_embeddings.weight", "transformer.wpe.weight"),
            AutoMapping("output_layer.weight", output),
            GPT2QKVMapping(layer + "self_attention.linear_qkv.weight", hf + "attn.c_attn.weight"),
            GPT2QKVMapping(layer + "self_attention.linear_qkv.bias", hf + "attn.c_attn.bias"),
        ]
        for ours, theirs in (("final_layernorm", "transformer.ln_f"),):
            mappings += [AutoMapping(f"decoder.{ours}.{p}", f"{theirs}.{p}") for p in ("weight", "bias")]
        pairs = (
            ("input_layernorm", "ln_1", False),
            ("pre_mlp_layernorm", "ln_2", False),
            ("self_attention.linear_proj", "attn.c_proj", True),
            ("mlp.linear_fc1", "mlp.c_fc", True),
            ("mlp.linear_fc2", "mlp.c_proj", True),
        )
        for ours, theirs, conv1d in pairs:
            conv1d_weight = (1, 0) if conv1d else None  # Conv1D is [in, out]; a bias needs no permute
            mappings += [
                AutoMapping(layer + f"{ours}.weight", hf + f"{theirs}.weight", permute_dims=conv1d_weight),
                AutoMapping(layer + f"{ours}.bias", hf + f"{theirs}.bias"),
            ]
        return MegatronMappingRegistry(*mappings)
