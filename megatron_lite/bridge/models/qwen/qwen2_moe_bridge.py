"""Qwen2-MoE: Qwen2's decoder whose MLPs are mixtures of experts with one gated shared expert
(``output * sigmoid(x . shared_expert_gate)``), except the layers ``decoder_sparse_step`` and
``mlp_only_layers`` keep dense (megatron-core's ``moe_layer_freq`` as a flag per layer).
``norm_topk_prob`` False keeps the top-k of the softmax over all experts as they are
(``moe_router_pre_softmax``); True renormalises them (the softmax over the top-k logits)."""

from __future__ import annotations

from megatron_lite.bridge.models.conversion.hf_config import HFConfig
from megatron_lite.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron_lite.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron_lite.bridge.models.conversion.param_mapping import (
    AutoMapping,
    GatedMLPMapping,
    routed_expert_mappings,
)
from megatron_lite.bridge.models.llama.llama_bridge import LlamaBridge, llama_like_registry
from megatron_lite.bridge.models.qwen.qwen2_bridge import QWEN2_DEFAULTS
from megatron_lite.core.models.gpt.gpt_model import GPTModel

# transformers' Qwen2MoeConfig defaults, for keys a config.json leaves out.
QWEN2_MOE_DEFAULTS = {
    **QWEN2_DEFAULTS,
    "intermediate_size": 5632,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "qkv_bias": True,
}


def sparse_layers(cfg: HFConfig) -> list[int]:
    """1 for each layer transformers builds as Qwen2MoeSparseMoeBlock, 0 for a dense Qwen2MoeMLP."""
    dense, step, experts = set(cfg["mlp_only_layers"]), cfg["decoder_sparse_step"], cfg["num_experts"]
    return [
        int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(cfg["num_hidden_layers"])
    ]


# CONFIG_MAPPING's mixture-of-experts fields, dropped where every layer is dense.
_MOE_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff")


@MegatronModelBridge.register_bridge(source="Qwen2MoeForCausalLM", target=GPTModel, model_type="qwen2_moe")
class Qwen2MoeBridge(LlamaBridge):
    """``Qwen2MoeForCausalLM``."""

    hf_config_defaults = QWEN2_MOE_DEFAULTS

    def check_hf_config(self, cfg: HFConfig) -> None:
        super().check_hf_config(cfg)
        if cfg["use_sliding_window"]:
            raise cfg.refuse("use_sliding_window", "sliding-window attention is not supported")
        if any(sparse_layers(cfg)) and cfg["shared_expert_intermediate_size"] < 1:
            raise cfg.refuse("shared_expert_intermediate_size", "a Qwen2-MoE layer has a shared expert")

    def hf_config_to_model_config_kwargs(self, hf_config) -> dict:
        cfg = HFConfig(hf_config, self.hf_config_defaults)
        kwargs = {
            **super().hf_config_to_model_config_kwargs(hf_config),
            "add_qkv_bias": bool(cfg["qkv_bias"]),
        }
        pattern = sparse_layers(cfg)
        if not any(pattern):  # every layer dense: a Qwen2 with Qwen2-MoE's names
            return {k: v for k, v in kwargs.items() if k not in _MOE_FIELDS}
        return {
            **kwargs,
            "num_moe_experts": cfg["num_experts"],
            "moe_layer_freq": 1 if all(pattern) else pattern,
            "moe_router_topk": cfg["num_experts_per_tok"],
            "moe_ffn_hidden_size": cfg["moe_intermediate_size"],
            "moe_shared_expert_intermediate_size": cfg["shared_expert_intermediate_size"],
            "moe_shared_expert_gate": True,
            "moe_router_pre_softmax": not cfg["norm_topk_prob"],
            "moe_router_score_function": "softmax",
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(cfg["router_aux_loss_coef"]),
        }

    def mapping_registry(self) -> MegatronMappingRegistry:
        layer, hf = "decoder.layers.*.", "model.layers.*.mlp."
        shared = layer + "mlp.shared_experts."
        return llama_like_registry(
            True,
            AutoMapping(layer + "mlp.router.weight", hf + "gate.weight"),
            *routed_expert_mappings(layer, hf + "experts.", "gate_proj", "up_proj", "down_proj"),
            GatedMLPMapping(
                shared + "linear_fc1.weight",
                hf + "shared_expert.gate_proj.weight",
                hf + "shared_expert.up_proj.weight",
            ),
            AutoMapping(shared + "linear_fc2.weight", hf + "shared_expert.down_proj.weight"),
            AutoMapping(shared + "gate_weight", hf + "shared_expert_gate.weight"),
        )
