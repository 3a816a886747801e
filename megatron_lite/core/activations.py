"""Activations the MLP can use besides torch's own, as megatron.core.activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (``--squared-relu``)."""
    return F.relu(x).pow(2)


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, OpenAI's (GPT-2's ``gelu_new``; ``--openai-gelu``). A function of
    its own, not a partial, so checkpoints record it by this name and refuse a run with the exact GELU."""
    return F.gelu(x, approximate="tanh")
