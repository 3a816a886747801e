"""LoRA (megatron_lite.peft, ``ConfigContainer.peft``) in the prediction: which linears carry an
adapter, the adapters' parameters, and what a layer saves with frozen base weights and adapters.

Parameters (:func:`adapter_parameters`): every base parameter is frozen (its weight stays, in its
dtype; no gradient buffer, no fp32 master, no optimizer state); each adapted linear adds
``adapter.linear_in.weight`` and ``adapter.linear_out.weight``, trainable, in the params' dtype, with
Bridge's shapes per tensor-parallel rank (r the LoRA dim, ``tp`` the linear's own TP size: the expert
TP size for a routed expert's): a column-parallel base (linear_qkv, linear_fc1, the output layer)
linear_in [r/tp, in], linear_out [out/tp, r]; a row-parallel base (linear_proj, linear_fc2)
linear_in [r, in/tp], linear_out [out/tp, r]. A routed expert linear's adapter is an expert
parameter (its own DDP buffer over expert data parallelism), one per grouped linear (shared by the
rank's local experts, ``share_expert_adapters``), one per local expert for the sequential experts.

Which linears: Bridge's matching (megatron_lite.peft.module_matcher) on the module's own name and on
its chunk-local path (``decoder.layers.<local i>.self_attention.linear_qkv``), the path
``named_modules`` gives before DDP wraps the chunk.

Saved activations (:func:`lora_layer_saves`, measured op by op on CPU: test_lora_memory.py), for t
tokens, t' under sequence parallelism, element size e, adapter dim r:

- a frozen linear keeps no input for a weight gradient: linear_qkv's and linear_fc1's inputs (the
  norms' outputs) and linear_fc2's (the activation's output), and the output layer's, are saved only
  where an adapter reads them; linear_proj's input is core attention's output, kept by the kernel;
- an adapter keeps its input (the base's input storage itself, a sequence-parallel base's gathered
  t h e copy for a column-parallel one) and linear_out's input, the low-rank t r e (whole r: gathered,
  or all-reduced for a row-parallel base); with dropout > 0 the dropped input (a copy) and its mask
  ("pre"), or the mask of the output ("post"): CUDA's a bool, the CPU's the noise in the input's dtype;
- on the first stage nothing requires a gradient before the first adapter: the embedding and the
  first layer's ops up to its first adapted linear save nothing.
"""

from megatron_lite.training.memory.predict.lora.saves import (
    dropout_mask_bytes,
    experts_fc2_adapted,
    lora_fc2_backward_extra,
    lora_fc2_released,
    lora_layer_saves,
    output_adapter_saves,
)
from megatron_lite.training.memory.predict.lora.targets import (
    COLUMN,
    ROW,
    Linear,
    adapter_parameters,
    adapter_shapes,
    dense_linears,
    expert_adapter_dim,
    is_adapted,
    lora_of,
    moe_linears,
)

__all__ = [
    "COLUMN",
    "ROW",
    "Linear",
    "adapter_parameters",
    "adapter_shapes",
    "dense_linears",
    "dropout_mask_bytes",
    "experts_fc2_adapted",
    "expert_adapter_dim",
    "is_adapted",
    "lora_fc2_backward_extra",
    "lora_fc2_released",
    "lora_layer_saves",
    "lora_of",
    "moe_linears",
    "output_adapter_saves",
]
