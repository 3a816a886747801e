"""Megatron-Bridge's ``PreTrainedTokenClassification``: a local ``*ForTokenClassification`` directory,
each part read on first use, with a vision-language model's processors as optional artifacts."""

from __future__ import annotations

from megatron_lite.bridge.models.hf_pretrained.masked_lm import PreTrainedMaskedLM


class PreTrainedTokenClassification(PreTrainedMaskedLM):
    OPTIONAL_ARTIFACTS = ["processor", "image_processor"]
    AUTO_MODEL_CLASS = "AutoModelForTokenClassification"

    def _load_model(self):
        self.config  # noqa: B018  (the model is built from the wrapper's config, loaded here)
        return self._load_auto_model(self.AUTO_MODEL_CLASS)

    def _load_processor(self):
        return self._load_optional("AutoProcessor")

    def _load_image_processor(self):
        processor = getattr(self, "_processor", None)
        if processor is not None and hasattr(processor, "image_processor"):
            return processor.image_processor
        return self._load_optional("AutoImageProcessor")

    @property
    def processor(self):
        if not hasattr(self, "_processor"):
            self._processor = self._load_processor()
        return self._processor

    @processor.setter
    def processor(self, value):
        self._processor = value

    @property
    def image_processor(self):
        if not hasattr(self, "_image_processor"):
            self._image_processor = self._load_image_processor()
        return self._image_processor

    @image_processor.setter
    def image_processor(self, value):
        self._image_processor = value
