"""Mistral: Llama's shape; its sliding-window attention is refused (megatron_lite attends to the whole
causal context), unless the window covers every position the model takes."""

from __future__ import annotations

from megatron_lite.bridge.models.conversion.hf_config import HFConfig
from megatron_lite.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron_lite.bridge.models.llama.llama_bridge import LLAMA_DEFAULTS, LlamaBridge
from megatron_lite.core.models.gpt.gpt_model import GPTModel

MISTRAL_DEFAULTS = {
    **LLAMA_DEFAULTS,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "sliding_window": 4096,
}


def refuse_sliding_window(cfg: HFConfig, window: int | None) -> None:
    """A window shorter than the longest sequence the model takes changes the attention: refused."""
    if window is not None and window < cfg["max_position_embeddings"]:
        raise cfg.refuse(
            "sliding_window",
            "sliding-window attention is not supported; set it to null in config.json to train with "
            "full causal attention",
        )


@MegatronModelBridge.register_bridge(source="MistralForCausalLM", target=GPTModel, model_type="mistral")
class MistralBridge(LlamaBridge):
    """``MistralForCausalLM``."""

    hf_config_defaults = MISTRAL_DEFAULTS

    def check_hf_config(self, cfg: HFConfig) -> None:
        super().check_hf_config(cfg)
        refuse_sliding_window(cfg, cfg.get("sliding_window"))
