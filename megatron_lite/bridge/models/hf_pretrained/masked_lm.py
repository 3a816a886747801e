"""Megatron-Bridge's ``PreTrainedMaskedLM``: a local encoder-only directory (``*ForMaskedLM``), each
part read on first use; no generation."""

from __future__ import annotations

from megatron_lite.bridge.models.hf_pretrained.base import transformers_auto
from megatron_lite.bridge.models.hf_pretrained.lazy_lm import LazyPreTrainedLM


class PreTrainedMaskedLM(LazyPreTrainedLM):
    """The model loads through ``AutoModelForMaskedLM``, or ``AutoModel`` where the config's class has
    no masked-LM head registered (as upstream)."""

    AUTO_MODEL_CLASS = "AutoModelForMaskedLM"

    def _load_model(self):
        if self._has_registered_masked_lm_head(self.config):
            return self._load_auto_model("AutoModelForMaskedLM")
        return self._load_auto_model("AutoModel")

    @staticmethod
    def _has_registered_masked_lm_head(config) -> bool:
        auto_map = getattr(config, "auto_map", None) or {}
        if "AutoModelForMaskedLM" in auto_map:
            return True
        mapping = transformers_auto("AutoModelForMaskedLM")._model_mapping
        return type(config) in mapping
