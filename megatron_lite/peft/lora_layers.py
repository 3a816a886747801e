"""Megatron-Bridge's ``LoRALinear`` (the base layer's output plus its adapter's) and ``LinearAdapter``
(the adapter of a plain ``nn.Linear``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from megatron_lite.peft.adapter_wrapper import AdapterWrapper
from megatron_lite.peft.lora_merge import LoRAMerge


class LoRALinear(AdapterWrapper):
    """``to_wrap(x) + adapter(x)``, returned the way ``to_wrap`` returns: ``(output, bias)`` for a
    tensor-parallel linear, a bare tensor for an expert linear. Under SP / TP the adapter's output
    is laid out as the base's (see ``ParallelLinearAdapter``)."""

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight: the base's plus ``scale * B @ A`` while the adapter is enabled
        (collective over the adapter's tensor-parallel group when it is larger than one)."""
        base_weight = self.to_wrap.weight
        if not self._adapter_enabled or base_weight is None:  # None: a tied output layer's
            return base_weight
        merged = LoRAMerge().merge(
            base_weight,
            self.adapter.linear_out.weight,
            self.adapter.linear_in.weight,
            self.adapter.alpha,
            self.adapter.dim,
            tp_group=getattr(self.adapter, "tp_group", None),
        )
        return merged.to(device=base_weight.device, dtype=base_weight.dtype)

    @property
    def bias(self) -> torch.Tensor | None:
        """The base's bias."""
        return getattr(self.to_wrap, "bias", None)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        linear_output, bias, adapter_input = self.base_linear_forward(x, *args, **kwargs)
        if self._adapter_enabled:
            adapter_output = self.adapter_forward(self.adapter, adapter_input.contiguous(), *args, **kwargs)
            linear_output = linear_output + adapter_output.reshape(linear_output.shape).to(
                linear_output.dtype
            )
        return (linear_output, bias) if self._base_returns_tuple else linear_output


class LinearAdapter(nn.Module):
    """The low-rank delta ``scale * linear_out(linear_in(x))`` for a plain ``nn.Linear`` (Bridge's):
    ``linear_in`` drawn xavier-uniform (or kaiming-uniform for any other ``lora_A_init_method``),
    ``linear_out`` zero, in ``lora_dtype`` or the base weight's dtype; the base's weights are not
    copied (``LoRALinear`` adds this to the base's output)."""

    def __init__(
        self,
        orig_linear: nn.Linear,
        dim: int = 8,
        alpha: int = 32,
        dropout: float = 0.0,
        dropout_position: str = "pre",
        lora_A_init_method: str = "xavier",
        lora_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(orig_linear, nn.Linear):
            raise TypeError(f"LinearAdapter adapts an nn.Linear, not a {type(orig_linear).__name__}")
        if dropout_position not in ("pre", "post"):
            raise ValueError(f"LoRA dropout_position must be 'pre' or 'post', not {dropout_position!r}")
        self.in_features, self.out_features = orig_linear.in_features, orig_linear.out_features
        self.dim, self.alpha, self.scale = dim, alpha, alpha / dim
        device, dtype = orig_linear.weight.device, lora_dtype or orig_linear.weight.dtype
        self.linear_in = nn.Linear(self.in_features, dim, bias=False, dtype=dtype, device=device)
        self.linear_out = nn.Linear(dim, self.out_features, bias=False, dtype=dtype, device=device)
        with torch.no_grad():
            if lora_A_init_method == "xavier":
                nn.init.xavier_uniform_(self.linear_in.weight)
            else:
                nn.init.kaiming_uniform_(self.linear_in.weight, a=math.sqrt(5))
            self.linear_out.weight.zero_()
        self.dropout = nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()
        self.dropout_position = dropout_position
        self.tp_group = None  # not split: a merge needs no collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout_position == "pre":
            x = self.dropout(x)
        out = self.linear_out(self.linear_in(x.to(self.linear_in.weight.dtype))) * self.scale
        if self.dropout_position == "post":
            out = self.dropout(out)
        return out
