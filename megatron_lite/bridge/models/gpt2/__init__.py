"""GPT-2."""

from megatron_lite.bridge.models.gpt2.gpt2_bridge import GPT2Bridge

__all__ = ["GPT2Bridge"]
