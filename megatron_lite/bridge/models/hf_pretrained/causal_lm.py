"""Megatron-Bridge's ``PreTrainedCausalLM``: a local causal-LM directory, each part read on first use.

hf = PreTrainedCausalLM.from_pretrained("/models/Llama-3.2-1B")  # reads nothing yet
hf.config                     # config.json (transformers' class for the model type when installed)
hf.state["model.norm.weight"] # one tensor, read from the safetensors files
hf.model                      # the transformers model (needs transformers), safetensors only
"""

from __future__ import annotations

from megatron_lite.bridge.models.hf_pretrained.lazy_lm import LazyPreTrainedLM, ProcessorArtifacts
from megatron_lite.bridge.models.hf_pretrained.state import StateDict

try:  # the model class upstream loads through (and tests patch here); only .model needs it
    from transformers import AutoModelForCausalLM
except ImportError:
    AutoModelForCausalLM = "AutoModelForCausalLM"


class PreTrainedCausalLM(ProcessorArtifacts, LazyPreTrainedLM):
    """A causal language model directory (``*ForCausalLM``), with its tokenizer, generation config
    and, for vision-language models, processors as optional artifacts."""

    OPTIONAL_ARTIFACTS = ["generation_config", "processor", "image_processor"]
    AUTO_MODEL_CLASS = "AutoModelForCausalLM"

    def __init__(
        self, model_name_or_path=None, device=None, torch_dtype=None, trust_remote_code=False, **kwargs
    ):
        super().__init__(model_name_or_path, device, torch_dtype, trust_remote_code, **kwargs)
        if model_name_or_path and trust_remote_code:
            self._original_source_path = model_name_or_path

    def _load_model(self):
        model = self._load_auto_model(AutoModelForCausalLM)
        generation_config = getattr(self, "_generation_config", None)
        if generation_config is not None and hasattr(model, "generation_config"):
            model.generation_config = generation_config
        return model

    def _load_generation_config(self):
        return self._load_optional("GenerationConfig")

    @property
    def auto_map_model_class(self) -> str | None:
        auto_map = getattr(self.config, "auto_map", None)
        if auto_map and "AutoModelForCausalLM" in auto_map:
            return str(auto_map["AutoModelForCausalLM"])
        return None

    @property
    def generation_config(self):
        if not hasattr(self, "_generation_config"):
            self._generation_config = self._load_generation_config()
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value):
        self._generation_config = value
        model = getattr(self, "_model", None)
        if model is not None and hasattr(model, "generation_config"):
            model.generation_config = value

    def generate(self, input_ids=None, **kwargs):
        """The model's ``generate`` with the wrapper's generation config."""
        model = self.model
        generation_config = getattr(self, "_generation_config", None)
        if generation_config is not None and hasattr(model, "generation_config"):
            model.generation_config = generation_config
        return model.generate(input_ids, **kwargs)


class _ConfigOnlyPretrainedShim(PreTrainedCausalLM):
    """A config and no weights: what ``AutoBridge.from_hf_config`` hands the provider bridge."""

    def __init__(self, config):
        super().__init__(
            model_name_or_path=getattr(config, "name_or_path", None),
            trust_remote_code=bool(getattr(config, "trust_remote_code", False)),
        )
        self.config = config
        self.generation_config = self._build_generation_config(config)

    @property
    def state(self) -> StateDict:
        raise AttributeError("Config-only pretrained wrappers do not have weight state.")

    @staticmethod
    def _build_generation_config(config):
        """The generation settings a config carries (transformers' GenerationConfig), or None."""
        try:
            from transformers import GenerationConfig
        except ImportError:
            return None
        try:
            return GenerationConfig.from_dict(config.to_dict() if hasattr(config, "to_dict") else {})
        except Exception:  # transformers validates the values; a config without any still has one
            return GenerationConfig()

    def __repr__(self) -> str:
        return f"_ConfigOnlyPretrainedShim(config={type(self.config).__name__})"
