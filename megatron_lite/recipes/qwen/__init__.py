"""Qwen recipes: the hardware-named functions (``h100``) and their short aliases (``qwen2``)."""

from megatron_lite.recipes.qwen.h100 import *  # noqa: F403
from megatron_lite.recipes.qwen.h100 import __all__ as _h100
from megatron_lite.recipes.qwen.qwen2 import *  # noqa: F403
from megatron_lite.recipes.qwen.qwen2 import __all__ as _aliases

__all__ = [*_h100, *_aliases]
