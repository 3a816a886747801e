"""Folding LoRA adapters into their base weights (Megatron-Bridge's ``LoRAMerge`` tensor helper) and
``merge_lora_model``, which replaces every ``LoRALinear`` of a model by its base layer holding
``W + scale * B @ A``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.process_group_utils import get_pg_size
from megatron_lite.peft.adapter_wrapper import AdapterWrapper


def _all_gather_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(get_pg_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class LoRAMerge:
    """Tensor helper: the base weight plus the LoRA update, per tensor-parallel rank."""

    def merge(
        self,
        base_weight: torch.Tensor,
        linear_out: torch.Tensor,
        linear_in: torch.Tensor,
        alpha: int,
        dim: int,
        *,
        tp_group: dist.ProcessGroup | None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``base_weight + scale * linear_out @ linear_in`` on this rank's shard (``scale``: default
        ``alpha / dim``). Collective over ``tp_group`` when it has more than one rank: every rank of
        it must call this. A column-parallel base ``(out/tp, in)`` gathers ``linear_in``
        ``(dim/tp, in)``; a row-parallel base ``(out, in/tp)`` gathers ``linear_out`` ``(out/tp, dim)``.
        Computed in float32 and returned in ``base_weight``'s dtype."""
        lora_scale = alpha / dim if scale is None else scale
        tp_size = get_pg_size(tp_group)
        if tp_size > 1:
            if linear_in.shape[0] * tp_size == dim and linear_out.shape[1] == dim:
                linear_in = _all_gather_rows(linear_in, tp_group)
            elif linear_out.shape[0] * tp_size == base_weight.shape[0]:
                linear_out = _all_gather_rows(linear_out, tp_group)
        update = lora_scale * (linear_out.float() @ linear_in.float())
        return (base_weight.float() + update).to(base_weight.dtype)


def merge_lora_model(model_chunks):
    """Replace every ``LoRALinear`` of ``model_chunks`` (a list of chunks or one module) by its base
    layer with the adapter folded into its weight(s); returns ``model_chunks``. Collective over
    each adapter's tensor-parallel group: every rank must call it. An expert layer's adapter shared
    by its local experts is folded into each of them; one per expert into its own."""
    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    for chunk in chunks:
        # named_modules lists parents before children: collect first, then replace in place.
        wrapped = [(name, m) for name, m in chunk.named_modules() if _is_lora(m)]
        for name, module in wrapped:
            base = module.to_wrap
            _fold(module, base)
            parent_name, _, child = name.rpartition(".")
            parent = chunk.get_submodule(parent_name) if parent_name else chunk
            setattr(parent, child, base)
    return model_chunks


def _is_lora(module: nn.Module) -> bool:
    """A LoRALinear (or any adapter wrapper whose adapter is a low-rank pair)."""
    return isinstance(module, AdapterWrapper) and hasattr(module.adapter, "linear_in")


@torch.no_grad()
def _fold(module: nn.Module, base: nn.Module) -> None:
    adapter = module.adapter
    if hasattr(adapter, "merge_into"):  # an adapter per local expert folds itself
        adapter.merge_into(base)
        return
    weights = (
        [base.weight] if hasattr(base, "weight") and isinstance(base.weight, torch.Tensor) else base.weights()
    )
    for weight in weights:
        merged = LoRAMerge().merge(
            weight,
            adapter.linear_out.weight,
            adapter.linear_in.weight,
            adapter.alpha,
            adapter.dim,
            tp_group=adapter.tp_group,
        )
        weight.copy_(merged)
