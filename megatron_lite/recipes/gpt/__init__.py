"""GPT recipes: vanilla GPT (``h100``, alias in ``vanilla_gpt``) and GPT-2 small on a CPU (``cpu``,
alias in ``gpt2``)."""

from megatron_lite.recipes.gpt.cpu import *  # noqa: F403
from megatron_lite.recipes.gpt.cpu import __all__ as _cpu
from megatron_lite.recipes.gpt.gpt2 import *  # noqa: F403
from megatron_lite.recipes.gpt.gpt2 import __all__ as _gpt2
from megatron_lite.recipes.gpt.h100 import *  # noqa: F403
from megatron_lite.recipes.gpt.h100 import __all__ as _h100
from megatron_lite.recipes.gpt.vanilla_gpt import *  # noqa: F403
from megatron_lite.recipes.gpt.vanilla_gpt import __all__ as _vanilla

__all__ = [*_h100, *_vanilla, *_cpu, *_gpt2]
