"""Rotary position embeddings (RoPE), as megatron.core.models.common.embeddings.rotary_pos_embedding.

``RotaryEmbedding`` gives the rotation angles of the positions this rank holds, shaped
``[s_local, 1, 1, rot_dim]``; ``rope_utils.apply_rotary_pos_emb`` rotates the first ``rot_dim``
channels of each query / key head by them and passes the rest through (``rotary_percent`` < 1).
Under context parallelism the angles are those of the rank's global positions (chunks ``r`` and
``2 cp - 1 - r``), so every layout rotates a token exactly as one process does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.utils import cp_positions


class RotaryEmbedding(nn.Module):
    """Angles ``position * base^(-2i / rot_dim)`` for ``rot_dim = int(kv_channels * rotary_percent)``.
    Holds no parameters (the inverse frequencies are a non-persistent buffer)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        use_cpu_initialization: bool = False,
        cp_group=None,
    ):
        super().__init__()
        if rope_scaling:
            raise NotImplementedError(
                "rope_scaling (Llama 3.1 frequency scaling) is not supported by megatron_lite"
            )
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        device = (
            "cpu" if use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        )
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        """Angles of this rank's positions of a ``max_seq_len``-token sequence (the global length)."""
        if packed_seq:
            raise NotImplementedError("packed sequences are not supported by megatron_lite")
        if self.cp_group is None:
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
