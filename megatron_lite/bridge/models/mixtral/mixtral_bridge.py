"""Mixtral: Mistral's decoder with every MLP a mixture of experts (Megatron-Bridge's MixtralBridge).
The router takes each token's top-k experts and renormalises their softmax probabilities, which is
megatron-core's softmax over the top-k logits (``moe_router_pre_softmax`` False)."""

from __future__ import annotations

from megatron_lite.bridge.models.conversion.hf_config import HFConfig
from megatron_lite.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron_lite.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron_lite.bridge.models.conversion.param_mapping import AutoMapping, routed_expert_mappings
from megatron_lite.bridge.models.llama.llama_bridge import LLAMA_DEFAULTS, LlamaBridge, llama_like_registry
from megatron_lite.bridge.models.mistral.mistral_bridge import refuse_sliding_window
from megatron_lite.core.models.gpt.gpt_model import GPTModel

# transformers' MixtralConfig defaults, for keys a config.json leaves out.
MIXTRAL_DEFAULTS = {
    **LLAMA_DEFAULTS,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "sliding_window": None,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001,
}


@MegatronModelBridge.register_bridge(source="MixtralForCausalLM", target=GPTModel, model_type="mixtral")
class MixtralBridge(LlamaBridge):
    """``MixtralForCausalLM``. Its ``router_jitter_noise`` (training-time noise on the router's input)
    is not carried over, as in Megatron-Bridge."""

    hf_config_defaults = MIXTRAL_DEFAULTS

    def check_hf_config(self, cfg: HFConfig) -> None:
        super().check_hf_config(cfg)
        refuse_sliding_window(cfg, cfg.get("sliding_window"))

    def hf_config_to_model_config_kwargs(self, hf_config) -> dict:
        cfg = HFConfig(hf_config, self.hf_config_defaults)
        return {
            **super().hf_config_to_model_config_kwargs(hf_config),
            "num_moe_experts": cfg["num_local_experts"],
            "moe_router_topk": cfg["num_experts_per_tok"],
            "moe_ffn_hidden_size": cfg["intermediate_size"],
            "moe_router_pre_softmax": False,
            "moe_router_score_function": "softmax",
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(cfg["router_aux_loss_coef"]),
        }

    def mapping_registry(self) -> MegatronMappingRegistry:
        layer, hf = "decoder.layers.*.", "model.layers.*.block_sparse_moe."
        return llama_like_registry(
            False,
            AutoMapping(layer + "mlp.router.weight", hf + "gate.weight"),
            *routed_expert_mappings(layer, hf + "experts.", "w1", "w3", "w2"),
        )
