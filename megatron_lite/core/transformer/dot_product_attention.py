"""Core causal attention, with context parallelism and packed sequences.

Under context parallelism each CP rank holds two of the sequence's ``2 cp`` chunks (chunk ``r`` and
chunk ``2 cp - 1 - r``, Megatron's load-balanced split, see ``get_batch_on_this_cp_rank``). Keys and
values are all-gathered across the CP group; every query attends to the gathered keys at global
positions up to its own. The gather's backward sums the key/value gradients of all ranks' queries.

A packed row (``PackedSeqParams``) is attended example by example, each exactly as it would be alone
(under CP each example is split the same way, see ``packed_seq_params``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.packed_seq_params import PackedSeqParams, check_cp_divisible, segment_boundaries
from megatron_lite.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron_lite.core.utils import cp_positions


def keeps_probabilities(dropout_p: float, masked: bool, gqa: bool, half: bool, device_type: str) -> bool:
    """Whether scaled_dot_product_attention takes its math path, which saves the s x s probabilities
    (softmax, dropout mask, dropped copy), as PyTorch's kernel selection does: only with dropout (the
    fused kernels need none without); always on the CPU, whose flash kernel has no dropout; on CUDA
    where neither fused kernel takes the call: flash needs bf16 / fp16 and no explicit mask (context
    parallelism gives one), the memory-efficient kernel no grouped-query heads."""
    if dropout_p == 0.0:
        return False
    if device_type != "cuda":
        return True
    return not (half and not masked) and gqa


_FUSED_DROPOUT_STAND_IN = [False]


@contextlib.contextmanager
def cuda_attention_kernels():
    """Attention with dropout as CUDA runs it, on fake tensors (the preflight's dry run of a GPU job):
    where a fused CUDA kernel would take the call (``keeps_probabilities``), the CPU flash kernel's op
    runs with the dropout probability instead of the math path, and saves what the fused kernel saves
    (q, k, v, the output and the log-sum-exp). Its kernel draws no dropout: for tensors without
    storage only."""
    _FUSED_DROPOUT_STAND_IN[0] = True
    try:
        yield
    finally:
        _FUSED_DROPOUT_STAND_IN[0] = False


def _fused_with_dropout(q, k, v, mask, dropout_p: float, causal: bool) -> torch.Tensor:
    """The fused kernels' allocation on fake tensors (see ``cuda_attention_kernels``): a boolean mask
    becomes the additive float mask SDPA makes of it; grouped k and v are read as they are."""
    if mask is not None:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, causal, attn_mask=mask
    )
    return out


class _AllGatherAlongSequence(torch.autograd.Function):
    """[b, h, s_local, d] -> [b, h, cp * s_local, d] in CP-rank order. Collective over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=2)[dist.get_rank(ctx.group)], None


class DotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask and optional dropout (per-TP-rank RNG stream)."""

    def __init__(self, attention_dropout: float = 0.0, cp_group=None):
        super().__init__()
        self.attention_dropout = attention_dropout
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """q [b, heads, s_local, d], k and v [b, groups, s_local, d] -> [b, heads, s_local, d]. Each
        key/value group serves ``heads / groups`` consecutive query heads (grouped-query attention).
        With ``packed_seq_params`` (one packed row, ``b == 1``) each example attends to itself only."""
        cp_size = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        if self.cp_group is not None:
            k = _AllGatherAlongSequence.apply(k, self.cp_group)
            v = _AllGatherAlongSequence.apply(v, self.cp_group)
        if packed_seq_params is None:
            return self._attend(q, k, v, q.size(2) * cp_size)
        return self._attend_packed(q, k, v, packed_seq_params, cp_size)

    def _attend_packed(self, q, k, v, packed_seq_params: PackedSeqParams, cp_size: int) -> torch.Tensor:
        """Attention example by example, each exactly as the example alone: no [s, s] block-diagonal
        mask is built, and the kernels hold sum(s_i^2) scores where a mask would make them s^2. Under CP
        an example's keys are its slices of every rank's gathered keys (each rank holds 1 / cp of each
        example), in the order ``cp_positions`` gives an unpacked sequence."""
        if q.size(0) != 1:
            raise ValueError(
                f"packed sequences need one packed row per micro batch (--micro-batch-size 1), got {q.size(0)}"
            )
        local = q.size(2)
        bounds = segment_boundaries(packed_seq_params, local * cp_size)
        check_cp_divisible(bounds, cp_size)
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            a, b = start // cp_size, end // cp_size  # this rank's share of the example
            if cp_size == 1:
                ks, vs = k[:, :, a:b], v[:, :, a:b]
            else:
                ks, vs = (
                    torch.cat([t[:, :, r * local + a : r * local + b] for r in range(cp_size)], 2)
                    for t in (k, v)
                )
            outputs.append(self._attend(q[:, :, a:b], ks, vs, end - start))
        return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]

    def _attend(self, q, k, v, seq: int) -> torch.Tensor:
        """Causal attention of one sequence of ``seq`` global tokens: q this rank's share, k and v all
        of it (gathered in CP-rank order under CP, then masked by global position)."""
        dropout_p = self.attention_dropout if self.training else 0.0
        mask, causal = None, True
        if self.cp_group is not None:
            cp_rank, cp_size = dist.get_rank(self.cp_group), dist.get_world_size(self.cp_group)
            query_pos = cp_positions(seq, cp_rank, cp_size, device=q.device)
            key_pos = torch.cat([cp_positions(seq, r, cp_size, device=q.device) for r in range(cp_size)])
            mask, causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1), False
        gqa = k.size(1) != q.size(1)
        half = q.dtype in (torch.bfloat16, torch.float16)
        fused_stand_in = (
            _FUSED_DROPOUT_STAND_IN[0]
            and dropout_p > 0.0
            and not keeps_probabilities(dropout_p, mask is not None, gqa, half, "cuda")
        )
        # Each TP rank holds different heads, so their dropout masks come from the per-rank stream.
        with get_cuda_rng_tracker().fork() if dropout_p > 0.0 else contextlib.nullcontext():
            if fused_stand_in:
                return _fused_with_dropout(q, k, v, mask, dropout_p, causal)
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=causal,
                enable_gqa=gqa,
            )
