"""Qwen2: Llama's shape with a bias on the query, key and value projections."""

from __future__ import annotations

from megatron_lite.bridge.models.conversion.hf_config import HFConfig
from megatron_lite.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron_lite.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron_lite.bridge.models.llama.llama_bridge import (
    LLAMA_DEFAULTS,
    llama_like_kwargs,
    llama_like_registry,
)

QWEN2_DEFAULTS = {
    **LLAMA_DEFAULTS,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
}


@MegatronModelBridge.register_bridge("qwen2")
class Qwen2Bridge(MegatronModelBridge):
    """``Qwen2ForCausalLM``."""

    def provider_kwargs(self, hf: dict) -> dict:
        cfg = HFConfig(hf, QWEN2_DEFAULTS)
        if cfg["use_sliding_window"]:
            raise cfg.refuse("use_sliding_window", "sliding-window attention is not supported")
        return {**llama_like_kwargs(cfg), "add_qkv_bias": True}

    def mapping_registry(self, config) -> MegatronMappingRegistry:
        return llama_like_registry(config, qkv_bias=True)
