"""An embedding lookup whose backward adds only the looked-up rows into the weight's ``main_grad``.

Autograd's embedding backward builds a dense vocabulary-sized gradient (zeros, then each token's row
added in order) that AccumulateGrad then adds into ``main_grad``: three passes over the whole table per
microbatch for the few hundred rows a microbatch touches (on CPU ~2.3 ms of the first pipeline stage's
every microbatch at vocab 8192 x hidden 256; the last stage's logits are far larger, but this stage
starts and ends every pipeline). Here the rows are summed per distinct id in the same order as the
dense kernel, then added once into ``main_grad``: the same bits (each untouched row of the dense
gradient is +0, which leaves ``main_grad`` unchanged), a fraction of the memory traffic. As upstream's
gradient_accumulation_fusion, the weight's ``.grad`` gets nothing from this node.

Only where that is exact and nothing waits on the weight's gradient hook: fp32 CPU weights whose
``.grad`` is DDP's ``main_grad`` with no overlapped reduction (DDP marks them
``main_grad_is_grad``), and a weight used by nothing else on this rank (a tied output layer on the
same stage would add its gradient in another order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake


def accumulates_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether :func:`embedding` may add ``weight``'s gradient straight into its ``main_grad``."""
    return (
        getattr(weight, "main_grad_is_grad", False)
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.is_grad_enabled()
        and weight.requires_grad
    )


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)  # the same saved bytes as F.embedding's backward node
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        if is_fake(ids):  # the preflight's dry run has no ids to compare: all distinct, the most bytes
            rows, position = torch.empty_like(ids.reshape(-1)), torch.empty_like(ids.reshape(-1))
        else:
            rows, position = torch.unique(ids.reshape(-1), return_inverse=True)
        # Per distinct id, its tokens' rows summed from zero in token order: the dense kernel's order.
        summed = grad_output.new_zeros(rows.numel(), grad_output.shape[-1])
        summed.index_add_(0, position, grad_output.reshape(-1, grad_output.shape[-1]))
        main_grad.index_add_(0, rows, summed)
        return None, None


def embedding(
    ids: torch.Tensor, weight: torch.Tensor, *, weight_used_elsewhere: bool = False
) -> torch.Tensor:
    """``F.embedding(ids, weight)``; its weight gradient goes straight into ``weight.main_grad`` where
    :func:`accumulates_into_main_grad` and the weight serves only this lookup."""
    if weight_used_elsewhere or not accumulates_into_main_grad(weight):
        return F.embedding(ids, weight)
    return _EmbeddingIntoMainGrad.apply(ids, weight)
