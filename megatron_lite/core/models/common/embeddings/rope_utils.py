"""Applying rotary embeddings to queries and keys, as megatron.core.models.common.embeddings.rope_utils."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.packed_seq_params import boundaries, thd_position_ids


def _rotate_half(x: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    if not rotary_interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def packed_rotary_pos_emb(freqs: torch.Tensor, cu_seqlens: torch.Tensor, local: int, cp_group=None):
    """The angles of this CP rank's ``local`` tokens of a packed row, [local, 1, 1, rot_dim], each by
    its position within its example, from ``freqs`` [n, 1, 1, rot_dim] of positions 0..n-1."""
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    bounds = boundaries(cu_seqlens, local * cp_size)
    positions = thd_position_ids(cu_seqlens, local * cp_size, cp_size, cp_rank, device=freqs.device)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if longest > freqs.size(0):
        raise ValueError(f"a packed example has {longest} positions but the rotary table {freqs.size(0)}")
    return freqs.index_select(0, positions)


def apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None
) -> torch.Tensor:
    """Rotate ``t`` [s, b, heads, d] by ``freqs`` [s, 1, 1, rot_dim] (``config.rotary_interleaved``
    chooses the channel pairing); channels past rot_dim pass through. ``freqs`` already holds this
    CP rank's positions, so ``cp_group`` is not needed. Computed in float32 and cast back.

    With ``cu_seqlens`` (a packed row, upstream's thd format) ``t`` is this CP rank's share of the
    row, [s_local, b, heads, d] or [s_local, heads, d], and ``freqs`` [n, 1, 1, rot_dim] the angles of
    positions 0..n-1 (``RotaryEmbedding(..., packed_seq=True)``): each token takes those of its
    position within its example, located through ``cp_group`` as the row was split."""
    if cu_seqlens is not None:
        freqs = packed_rotary_pos_emb(freqs, cu_seqlens, t.size(0), cp_group)
        if t.dim() == 3:
            freqs = freqs.squeeze(1)
    rotary_interleaved = config.rotary_interleaved
    rot_dim = freqs.size(-1)
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = (torch.cos(freqs) * mscale), (torch.sin(freqs) * mscale)
    x = rotated.float()
    rotated = (x * cos + _rotate_half(x, rotary_interleaved) * sin).to(t.dtype)
    return torch.cat((rotated, passed), dim=-1) if passed.numel() else rotated
