"""The adapters' initialisers by name (Megatron-Bridge's ``ParallelLinearAdapter._get_init_fn``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, sigma)."""
    return lambda tensor: nn.init.normal_(tensor, mean=0.0, std=sigma)


def init_method_kaiming_uniform(val: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Kaiming uniform with negative slope ``val``."""
    return lambda tensor: nn.init.kaiming_uniform_(tensor, a=val)


def init_method_const(val: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Every element ``val``."""
    return lambda tensor: nn.init.constant_(tensor, val)


INIT_METHODS = ("xavier", "normal", "kaiming", "zero")


def get_init_fn(init_method: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Bridge's adapter initialisers by name: ``xavier`` (normal), ``normal`` (sigma 0.2),
    ``kaiming`` (uniform, a = sqrt(5)), ``zero``."""
    if init_method == "xavier":
        return nn.init.xavier_normal_
    if init_method == "normal":
        return init_method_normal(0.2)
    if init_method == "kaiming":
        return init_method_kaiming_uniform(math.sqrt(5))
    if init_method == "zero":
        return init_method_const(0.0)
    raise ValueError(f"LoRA init method {init_method!r} is not one of {', '.join(INIT_METHODS)}")
