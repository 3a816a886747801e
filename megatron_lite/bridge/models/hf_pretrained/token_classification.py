"""Megatron-Bridge's ``PreTrainedTokenClassification``: a local ``*ForTokenClassification`` directory,
each part read on first use, with a vision-language model's processors as optional artifacts."""

from __future__ import annotations

from megatron_lite.bridge.models.hf_pretrained.lazy_lm import ProcessorArtifacts
from megatron_lite.bridge.models.hf_pretrained.masked_lm import PreTrainedMaskedLM


class PreTrainedTokenClassification(ProcessorArtifacts, PreTrainedMaskedLM):
    OPTIONAL_ARTIFACTS = ["processor", "image_processor"]
    AUTO_MODEL_CLASS = "AutoModelForTokenClassification"

    def _load_model(self):
        self.config  # noqa: B018  (the model is built from the wrapper's config, loaded here)
        return self._load_auto_model(self.AUTO_MODEL_CLASS)
