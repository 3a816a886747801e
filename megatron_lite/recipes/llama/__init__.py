"""Llama recipes: the hardware-named functions (``h100``) and their short aliases (``llama3``)."""

from megatron_lite.recipes.llama.h100 import *  # noqa: F403
from megatron_lite.recipes.llama.h100 import __all__ as _h100
from megatron_lite.recipes.llama.llama3 import *  # noqa: F403
from megatron_lite.recipes.llama.llama3 import __all__ as _aliases

__all__ = [*_h100, *_aliases]
