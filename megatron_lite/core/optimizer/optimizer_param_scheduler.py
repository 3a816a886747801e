"""OptimizerParamScheduler: learning-rate warmup then constant / linear / cosine decay (Megatron's)."""

from __future__ import annotations

import math


class OptimizerParamScheduler:
    """Steps are counted in samples, as in Megatron: ``step(increment=global_batch_size)``."""

    def __init__(
        self,
        optimizer,
        *,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
    ):
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = init_lr, max_lr, min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        if lr_decay_steps <= 0 or lr_warmup_steps > lr_decay_steps:
            raise ValueError("lr_decay_steps must be positive and at least lr_warmup_steps")
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * n / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.max_lr
        if n > self.lr_decay_steps:
            return self.min_lr
        ratio = (n - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"unknown lr decay style {self.lr_decay_style}")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "lr_decay_steps": self.lr_decay_steps,
            "lr_decay_style": self.lr_decay_style,
        }

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]
        self.step(0)
