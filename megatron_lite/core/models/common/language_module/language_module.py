"""LanguageModule: what every language model shares, as megatron.core.models.common.language_module."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core import tensor_parallel


class LanguageModule(nn.Module):
    """A model with ``config`` (a TransformerConfig) and ``tp_group`` whose last stage emits logits
    split over the vocabulary."""

    def __init__(self, config, tp_group=None) -> None:
        super().__init__()
        self.config = config
        self.tp_group = tp_group

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy, [b, s], from ``labels`` [b, s] and ``logits`` [s, b, vocab / tp].
        Collective over ``self.tp_group``. The fused kernels (``cross_entropy_loss_fusion``) are not
        supported, so it always takes the vocab-parallel path."""
        if getattr(self.config, "cross_entropy_loss_fusion", False):
            raise NotImplementedError("cross_entropy_loss_fusion is not supported by megatron_lite")
        loss = tensor_parallel.vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1).contiguous(), tp_group=self.tp_group
        )
        return loss.transpose(0, 1).contiguous()
