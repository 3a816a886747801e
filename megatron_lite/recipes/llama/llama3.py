"""The short (legacy) Llama 3 recipe names, aliases of the hardware-named ones as upstream's
``recipes/llama/llama3.py`` maps them."""

from megatron_lite.recipes.llama.h100.llama3 import (
    llama3_8b_peft_1gpu_h100_bf16_config as llama3_8b_peft_config,
)
from megatron_lite.recipes.llama.h100.llama3 import (
    llama3_8b_pretrain_2gpu_h100_bf16_config as llama3_8b_pretrain_config,
)
from megatron_lite.recipes.llama.h100.llama3 import (
    llama3_8b_sft_2gpu_h100_bf16_config as llama3_8b_sft_config,
)
from megatron_lite.recipes.llama.h100.llama3 import (
    llama3_70b_peft_8gpu_h100_bf16_config as llama3_70b_peft_config,
)
from megatron_lite.recipes.llama.h100.llama3 import (
    llama3_70b_pretrain_32gpu_h100_bf16_config as llama3_70b_pretrain_config,
)
from megatron_lite.recipes.llama.h100.llama3 import (
    llama3_70b_sft_32gpu_h100_bf16_config as llama3_70b_sft_config,
)

__all__ = [
    "llama3_70b_peft_config",
    "llama3_70b_pretrain_config",
    "llama3_70b_sft_config",
    "llama3_8b_peft_config",
    "llama3_8b_pretrain_config",
    "llama3_8b_sft_config",
]
