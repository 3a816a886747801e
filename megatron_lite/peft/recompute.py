"""Full activation recompute with a frozen base (Megatron-Bridge's ``peft.recompute``).

A recomputed layer is a reentrant checkpoint: autograd runs its backward only when one of its
inputs requires a gradient. With the base frozen and no pipeline stage before it, the decoder's
input (the embedding's output) requires none, so the adapters inside the recomputed layers would
get no gradient at all. A forward pre-hook on each TransformerBlock marks that input as requiring
one; no parameter is unfrozen.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from megatron_lite.core.transformer.transformer_block import TransformerBlock

logger = logging.getLogger(__name__)

_HOOKED = "_peft_recompute_inputs_grad"


def _input_requires_grad(module: nn.Module, args: tuple, kwargs: dict):
    if args:
        hidden = args[0]
        if torch.is_tensor(hidden) and hidden.is_floating_point() and not hidden.requires_grad:
            return (hidden.detach().requires_grad_(True), *args[1:]), kwargs
        return None
    hidden = kwargs.get("hidden_states")
    if torch.is_tensor(hidden) and hidden.is_floating_point() and not hidden.requires_grad:
        return args, {**kwargs, "hidden_states": hidden.detach().requires_grad_(True)}
    return None


def maybe_enable_recompute_inputs_grad(model) -> int:
    """Under full recompute with only adapters trainable, make each TransformerBlock's input require a
    gradient (see the module docstring); returns how many blocks were hooked (each once)."""
    chunks = model if isinstance(model, list) else [getattr(model, "module", model)]
    hooked = 0
    for chunk in chunks:
        config = getattr(chunk, "config", None)
        if getattr(config, "recompute_granularity", None) != "full":
            continue
        params = list(chunk.named_parameters())
        adapters = any(p.requires_grad and ".adapter." in n for n, p in params)
        base = any(p.requires_grad and ".adapter." not in n for n, p in params)
        if not adapters or base:
            continue  # something before the blocks trains: its output already requires a gradient
        for module in chunk.modules():
            if isinstance(module, TransformerBlock) and not getattr(module, _HOOKED, False):
                module.register_forward_pre_hook(_input_requires_grad, with_kwargs=True)
                setattr(module, _HOOKED, True)
                hooked += 1
    if hooked:
        logger.info("PEFT with full recompute: %d TransformerBlock input(s) made to require grad", hooked)
    return hooked
