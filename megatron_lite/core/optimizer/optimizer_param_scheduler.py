"""OptimizerParamScheduler: learning-rate warmup then constant / linear / cosine decay, and the
weight-decay increment schedule (Megatron's)."""

from __future__ import annotations

import math

# (state key, attribute, what Megatron calls it in its mismatch message)
_CHECKED = (
    ("max_lr", "max_lr", "learning rate"),
    ("min_lr", "min_lr", "minimum learning rate"),
    ("lr_warmup_steps", "lr_warmup_steps", "warmup iterations"),
    ("lr_decay_steps", "lr_decay_steps", "total number of iterations"),
    ("lr_decay_style", "lr_decay_style", "learning rate decay style"),
    ("start_wd", "start_wd", "start weight decay"),
    ("end_wd", "end_wd", "end weight decay"),
    ("wd_incr_steps", "wd_incr_steps", "total number of weight decay iterations"),
    ("wd_incr_style", "wd_incr_style", "weight decay incr style"),
)


class OptimizerParamScheduler:
    """Steps are counted in samples, as in Megatron: ``step(increment=global_batch_size)``.

    Each step sets every group's ``lr`` and its ``weight_decay`` (the schedule's value times the
    group's ``wd_mult``: 0 for biases and norms). On resume the checkpoint's schedule must equal this
    run's unless ``override_opt_param_scheduler`` (this run's wins) or
    ``use_checkpoint_opt_param_scheduler`` (the checkpoint's wins), as upstream.
    """

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
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str = "constant",
        use_checkpoint_opt_param_scheduler: bool = False,
        override_opt_param_scheduler: bool = False,
    ):
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = init_lr, max_lr, min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        if lr_decay_steps <= 0 or lr_warmup_steps > lr_decay_steps:
            raise ValueError("lr_decay_steps must be positive and at least lr_warmup_steps")
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        if not 0.0 <= start_wd <= end_wd:
            raise ValueError(f"weight decay must rise from start_wd {start_wd} >= 0 to end_wd {end_wd}")
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
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

    def get_wd(self) -> float:
        """Weight decay: start_wd rising to end_wd over wd_incr_steps (linear or cosine), or constant."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        else:
            raise ValueError(f"unknown weight decay increment style {self.wd_incr_style}")
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int) -> None:
        self.num_steps += increment
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **{key: getattr(self, attr) for key, attr, _ in _CHECKED}}

    def checkpoint_mismatch(self, state: dict) -> str | None:
        """Megatron's words for the first schedule value a checkpoint holds that differs from this
        run's, when neither override nor use-checkpoint is set; else None. Nothing changes."""
        if self.override_opt_param_scheduler or self.use_checkpoint_opt_param_scheduler:
            return None
        for key, attr, name in _CHECKED:
            if key in state and state[key] != getattr(self, attr):
                return (
                    f"OptimizerParamScheduler: class input value {getattr(self, attr)} and checkpoint "
                    f"value {state[key]} for {name} do not match (--override-opt-param-scheduler takes "
                    "this run's, --use-checkpoint-opt-param-scheduler the checkpoint's)"
                )
        return None

    def load_state_dict(self, state: dict) -> None:
        mismatch = self.checkpoint_mismatch(state)
        if mismatch is not None:
            raise ValueError(mismatch)
        if not self.override_opt_param_scheduler:
            for key, attr, _ in _CHECKED:
                if key in state:  # checkpoints from before the weight-decay schedule lack its keys
                    setattr(self, attr, state[key])
        self.num_steps = state["num_steps"]
        self.step(0)
