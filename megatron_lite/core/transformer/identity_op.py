"""Placeholders a layer spec puts where a layer has no such part (megatron.core.transformer.identity_op)."""

from __future__ import annotations

from torch import nn


class IdentityOp(nn.Module):
    """Returns its first input; takes and ignores any constructor arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """Returns a function that returns its first input (where a spec expects a function builder)."""

    def forward(self, *args, **kwargs):
        return super().forward
