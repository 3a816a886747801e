"""Parts of megatron-core's ``transformer.module``: marking tensors that stay in fp32 when a model is
cast to half precision, and the cast that honours the mark."""

from __future__ import annotations

import torch


def mark_keep_in_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a parameter or buffer to stay fp32 in ``convert_module_to_dtype_except_fp32_marked``;
    returns it."""
    tensor.keep_in_fp32 = True
    return tensor


def convert_module_to_dtype_except_fp32_marked(
    module: torch.nn.Module, dtype: torch.dtype
) -> torch.nn.Module:
    """Cast ``module``'s floating-point parameters and buffers to ``dtype`` in place, but the marked."""
    return module._apply(
        lambda t: t.to(dtype) if t.is_floating_point() and not getattr(t, "keep_in_fp32", False) else t
    )
