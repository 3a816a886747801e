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
        Collective over ``self.tp_group``. With ``cross_entropy_loss_fusion`` the loss is computed with
        the output layer, never from whole logits (GPTModel.forward, fusions/fused_linear_cross_entropy):
        given logits, this takes the vocab-parallel path."""
        loss = tensor_parallel.vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1).contiguous(), tp_group=self.tp_group
        )
        return loss.transpose(0, 1).contiguous()
