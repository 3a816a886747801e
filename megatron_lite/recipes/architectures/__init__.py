"""Published Hugging Face ``config.json`` values of the models the recipes train, carried as data.

Megatron-Bridge's recipes read the architecture from the hub
(``AutoBridge.from_hf_pretrained("meta-llama/Meta-Llama-3-70B").get_model_config()``); the hub is not
reachable here, so each family module holds the published values and :func:`model_config` converts
them with megatron_lite's bridge (the same mapping an import uses, no ``transformers`` needed).
"""

from __future__ import annotations

from megatron_lite.models.gpt_provider import GPTModelProvider


def _family_bridge(architecture: str):
    # Imported when a recipe is built: the bridge is a sibling floor and costs a second to import.
    from megatron_lite.bridge.models.gpt2.gpt2_bridge import GPT2Bridge
    from megatron_lite.bridge.models.llama.llama_bridge import LlamaBridge
    from megatron_lite.bridge.models.mixtral.mixtral_bridge import MixtralBridge
    from megatron_lite.bridge.models.qwen.qwen2_bridge import Qwen2Bridge

    bridges = {
        "LlamaForCausalLM": LlamaBridge,
        "Qwen2ForCausalLM": Qwen2Bridge,
        "MixtralForCausalLM": MixtralBridge,
        "GPT2LMHeadModel": GPT2Bridge,
    }
    return bridges[architecture]()


def model_config(hf_config: dict) -> GPTModelProvider:
    """The GPTModelProvider of a published ``config.json`` (a dict), as Megatron-Bridge's
    ``AutoBridge.get_model_config()`` gives it: the architecture plus the training defaults the bridge
    sets on every imported model (the fused loss, freed pipeline outputs)."""
    model = _family_bridge(hf_config["architectures"][0]).provider_bridge(dict(hf_config))
    model.apply_rope_fusion = False  # the bridge sets upstream's True: a fused kernel megatron_lite lacks
    return model
