"""GPT model."""

from megatron_lite.core.models.gpt.gpt_model import GPTModel

__all__ = ["GPTModel"]
