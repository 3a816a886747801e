"""Megatron-Bridge's layout: megatron.bridge.models.hf_pretrained (local Hugging Face directories,
each part read on first use)."""

from megatron_lite.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM
from megatron_lite.bridge.models.hf_pretrained.masked_lm import PreTrainedMaskedLM
from megatron_lite.bridge.models.hf_pretrained.token_classification import PreTrainedTokenClassification

__all__ = ["PreTrainedCausalLM", "PreTrainedMaskedLM", "PreTrainedTokenClassification"]
