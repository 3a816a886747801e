"""Optimizer and learning-rate schedule pairs, Megatron-Bridge's ``recipes.utils.optimizer_utils``
with its names, arguments and defaults. "Distributed fused Adam" is Adam(W) with its state sharded
over data parallelism (megatron_lite's distributed optimizer) and cosine decay."""

from __future__ import annotations

from megatron_lite.training.config import OptimizerConfig, SchedulerConfig


def _distributed_adam(precision, adam_beta1, adam_beta2, adam_eps, weight_decay, max_lr, min_lr, clip_grad):
    return OptimizerConfig(
        optimizer="adam",
        lr=max_lr,
        min_lr=min_lr if min_lr is not None else 0.1 * max_lr,
        weight_decay=weight_decay,
        bf16=precision == "bf16-mixed",
        fp16=precision == "16-mixed",
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        use_distributed_optimizer=True,
        clip_grad=clip_grad,
    )


def distributed_fused_adam_with_cosine_annealing(
    precision: str = "bf16-mixed",
    lr_warmup_iters: int = 2000,
    lr_decay_iters: int | None = None,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.95,
    adam_eps: float = 1e-8,
    weight_decay: float = 0.1,
    max_lr: float = 1e-4,
    min_lr: float | None = None,
    clip_grad: float = 1.0,
    start_weight_decay: float = 0.033,
    end_weight_decay: float = 0.033,
    weight_decay_incr_style: str = "constant",
    lr_decay_style: str = "cosine",
) -> tuple[OptimizerConfig, SchedulerConfig]:
    """Distributed Adam with warmup then cosine decay over iterations (``lr_decay_iters`` None: the
    run's length); ``min_lr`` None is a tenth of ``max_lr``. The schedule's weight decay
    (``start_weight_decay`` .. ``end_weight_decay``) is the one applied, as upstream."""
    optimizer = _distributed_adam(
        precision, adam_beta1, adam_beta2, adam_eps, weight_decay, max_lr, min_lr, clip_grad
    )
    scheduler = SchedulerConfig(
        start_weight_decay=start_weight_decay,
        end_weight_decay=end_weight_decay,
        weight_decay_incr_style=weight_decay_incr_style,
        lr_decay_style=lr_decay_style,
        lr_wsd_decay_style="minus_sqrt",
        lr_wsd_decay_iters=lr_decay_iters,
        lr_warmup_iters=lr_warmup_iters,
        lr_warmup_init=0.0,
        lr_decay_iters=lr_decay_iters,
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler


def distributed_fused_adam_with_cosine_annealing_samples(
    precision: str = "bf16-mixed",
    lr_warmup_samples: int | None = None,
    lr_decay_samples: int | None = None,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.95,
    adam_eps: float = 1e-8,
    weight_decay: float = 0.1,
    max_lr: float = 1e-4,
    min_lr: float | None = None,
    clip_grad: float = 1.0,
) -> tuple[OptimizerConfig, SchedulerConfig]:
    """:func:`distributed_fused_adam_with_cosine_annealing` for sample-based training
    (``TrainingConfig.train_samples``): warmup and decay counted in samples."""
    optimizer = _distributed_adam(
        precision, adam_beta1, adam_beta2, adam_eps, weight_decay, max_lr, min_lr, clip_grad
    )
    scheduler = SchedulerConfig(
        start_weight_decay=0.033,
        end_weight_decay=0.033,
        weight_decay_incr_style="constant",
        lr_decay_style="cosine",
        lr_warmup_samples=0 if lr_warmup_samples is None else lr_warmup_samples,  # None: no warmup
        lr_warmup_init=0.0,
        lr_decay_samples=lr_decay_samples,  # None: decay over the run's samples
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler
