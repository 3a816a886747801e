"""Activations the MLP can use besides torch's own, as megatron.core.activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (``--squared-relu``)."""
    return F.relu(x).pow(2)
