"""Qwen2: Llama's shape with a bias on the query, key and value projections."""

from __future__ import annotations

from megatron_lite.bridge.models.conversion.hf_config import HFConfig
from megatron_lite.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron_lite.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron_lite.bridge.models.llama.llama_bridge import LLAMA_DEFAULTS, LlamaBridge, llama_like_registry
from megatron_lite.core.models.gpt.gpt_model import GPTModel

QWEN2_DEFAULTS = {
    **LLAMA_DEFAULTS,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
}


@MegatronModelBridge.register_bridge(source="Qwen2ForCausalLM", target=GPTModel, model_type="qwen2")
class Qwen2Bridge(LlamaBridge):
    """``Qwen2ForCausalLM``."""

    hf_config_defaults = QWEN2_DEFAULTS

    def check_hf_config(self, cfg: HFConfig) -> None:
        super().check_hf_config(cfg)
        if cfg["use_sliding_window"]:
            raise cfg.refuse("use_sliding_window", "sliding-window attention is not supported")

    def hf_config_to_model_config_kwargs(self, hf_config) -> dict:
        return {**super().hf_config_to_model_config_kwargs(hf_config), "add_qkv_bias": True}

    def mapping_registry(self) -> MegatronMappingRegistry:
        return llama_like_registry(qkv_bias=True)
