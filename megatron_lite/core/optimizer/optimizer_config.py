"""OptimizerConfig: Adam hyper-parameters, clipping and precision."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW with decoupled weight decay; fp32 master weights when bf16 is on."""

    optimizer: str = "adam"
    """Only adam (AdamW) is supported."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay on weight matrices (not on biases or norms)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip over all model-parallel ranks; 0 disables."""
    bf16: bool = False
    """bf16 model with fp32 master weights and optimizer state."""
    fp16: bool = False
    """fp16 with loss scaling (not supported yet)."""
