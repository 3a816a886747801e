"""Rotary position embeddings (RoPE), as megatron.core.models.common.embeddings.rotary_pos_embedding.

``RotaryEmbedding`` gives the rotation angles of the positions this rank holds, shaped
``[s_local, 1, 1, rot_dim]``; ``rope_utils.apply_rotary_pos_emb`` rotates the first ``rot_dim``
channels of each query / key head by them and passes the rest through (``rotary_percent`` < 1).
Under context parallelism the angles are those of the rank's global positions (chunks ``r`` and
``2 cp - 1 - r``), so every layout rotates a token exactly as one process does. ``rope_scaling``
slows the low frequencies as Llama 3.x does (``_apply_scaling``). A packed row (``packed_seq``) takes
the angles of positions within each example instead (``rope_utils``, by its ``cu_seqlens``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.utils import cp_positions


class RotaryEmbedding(nn.Module):
    """Angles ``position * base^(-2i / rot_dim)`` for ``rot_dim = int(kv_channels * rotary_percent)``.
    Holds no parameters (the inverse frequencies are a non-persistent buffer). ``rope_scaling``
    rescales them as Llama 3.x (``--use-rope-scaling``, ``--rope-scaling-factor``)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
        cp_group=None,
    ):
        super().__init__()
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        device = (
            "cpu" if use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        )
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        if rope_scaling:
            inv_freq = self._apply_scaling(inv_freq, factor=rope_scaling_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply_scaling(
        self,
        freqs: torch.Tensor,
        factor: float = 8,
        low_freq_factor: float = 1,
        high_freq_factor: float = 4,
        original_max_position_embeddings: int = 8192,
    ) -> torch.Tensor:
        """Llama 3.x's frequencies (upstream's signature and formula, as transformers' ``llama3``):
        wavelengths shorter than ``original / high_freq_factor`` are kept, those longer than
        ``original / low_freq_factor`` divided by ``factor``, and the ones between blended smoothly,
        so the model stretches its long-range channels only and keeps its local ones."""
        low_freq_wavelen = original_max_position_embeddings / low_freq_factor
        high_freq_wavelen = original_max_position_embeddings / high_freq_factor
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
        # 0 at the low-frequency end, 1 at the high-frequency end of the band between them.
        smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        """Angles of this rank's positions of a ``max_seq_len``-token sequence (the global length).
        With ``packed_seq`` those of positions ``0..max_seq_len-1`` on every rank (upstream's thd
        table): ``apply_rotary_pos_emb(..., cu_seqlens=...)`` picks each token's by its position within
        its example."""
        if packed_seq or self.cp_group is None:
            positions = torch.arange(max_seq_len, device=self.inv_freq.device) + offset
        else:
            cp_rank, cp_size = dist.get_rank(self.cp_group), dist.get_world_size(self.cp_group)
            positions = cp_positions(max_seq_len, cp_rank, cp_size, device=self.inv_freq.device) + offset
        positions = positions.to(self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = torch.outer(positions, self.inv_freq)
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # f0 f1 ... f0 f1 ...
        return emb[:, None, None, :]

    def get_rotary_seq_len(self, transformer_input: torch.Tensor, cp_size: int = 1) -> int:
        """The global sequence length of ``transformer_input`` [s_local, b, h]."""
        return transformer_input.size(0) * cp_size
