"""Applying rotary embeddings to queries and keys, as megatron.core.models.common.embeddings.rope_utils."""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    if not rotary_interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None
) -> torch.Tensor:
    """Rotate ``t`` [s, b, heads, d] by ``freqs`` [s, 1, 1, rot_dim] (``config.rotary_interleaved``
    chooses the channel pairing); channels past rot_dim pass through. ``freqs`` already holds this
    CP rank's positions, so ``cp_group`` is not needed. Computed in float32 and cast back."""
    if cu_seqlens is not None:
        raise NotImplementedError("packed sequences (cu_seqlens) are not supported by megatron_lite")
    rotary_interleaved = config.rotary_interleaved
    rot_dim = freqs.size(-1)
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = (torch.cos(freqs) * mscale), (torch.sin(freqs) * mscale)
    x = rotated.float()
    rotated = (x * cos + _rotate_half(x, rotary_interleaved) * sin).to(t.dtype)
    return torch.cat((rotated, passed), dim=-1) if passed.numel() else rotated
