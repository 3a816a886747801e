"""The loop-length, validation and learning-rate-schedule sections of ConfigContainer.

Names and defaults are Megatron-Bridge's (``megatron.bridge.training.config``). Each section's
``finalize()`` checks itself and fills what it derives; it may run more than once (a changed field is
picked up, an unchanged config stays the same). Fields of features not built yet keep upstream's
name and default, and ConfigContainer.validate refuses any other value.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from megatron_lite.training.errors import ConfigError, require


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes and loop length: give exactly one of ``train_iters`` and ``train_samples``."""

    micro_batch_size: int | None = None
    """Samples per microbatch on one data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per iteration across all data-parallel ranks and microbatches."""
    rampup_batch_size: list[int] | None = None
    """Batch-size ramp-up (not supported yet: None)."""
    train_iters: int | None = None
    """Iterations to train."""
    train_samples: int | None = None
    """Samples to train; finalize() turns it into train_iters = train_samples // global_batch_size."""
    num_epochs: float | None = None
    """Passes over a finite dataset (not supported: the mock data is unbounded)."""
    exit_interval: int | None = None
    """Stop (after saving, when a save directory is set) once the iteration is a multiple of this."""
    exit_duration_in_mins: int | None = None
    """Stop after this many minutes (not supported yet: None)."""
    exit_signal_handler: bool = False
    """On SIGTERM, finish the current iteration, save a checkpoint and exit 0."""
    eval_iters: int | None = None
    """Deprecated spelling of ValidationConfig.eval_iters (copied there by validate)."""
    eval_interval: int | None = None
    """Deprecated spelling of ValidationConfig.eval_interval (copied there by validate)."""
    skip_train: bool | None = None
    """Deprecated spelling of ValidationConfig.skip_train (copied there by validate)."""
    _train_iters_from_num_epochs: bool = field(default=False, init=False, repr=False)

    def finalize(self) -> None:
        modes = sum(x is not None for x in (self.train_iters, self.train_samples, self.num_epochs))
        require(
            modes > 0, "--train-iters", "One of train_iters, train_samples, or num_epochs must be provided"
        )
        if self.train_samples is not None and self.train_iters is not None and self._derived_iters():
            modes -= 1  # train_iters was derived by an earlier finalize()
        require(
            modes == 1,
            "--train-samples",
            "Cannot specify more than one of train_iters, train_samples, or num_epochs",
        )
        if self.num_epochs is not None:
            require(self.num_epochs > 0, "train.num_epochs", "num_epochs must be a positive number")
            require(
                self.rampup_batch_size is None,
                "train.rampup_batch_size",
                "Batch size rampup not supported with epoch-based training",
            )
        if self.train_samples is not None:
            require(self.train_samples > 0, "--train-samples", "train_samples must be positive")
            require(
                self.rampup_batch_size is None,
                "--rampup-batch-size",
                "Batch size rampup not supported with sample-based training yet",
            )
            require(
                self.global_batch_size is not None,
                "--global-batch-size",
                "global_batch_size must be set when using train_samples",
            )
            self.train_iters = self.train_samples // self.global_batch_size
            self._iters_from_samples = (self.train_samples, self.global_batch_size, self.train_iters)

    def _derived_iters(self) -> bool:
        # True when train_iters is exactly what the last finalize() derived from the same samples.
        derived = self.__dict__.get("_iters_from_samples")
        return derived == (self.train_samples, self.global_batch_size, self.train_iters)


@dataclass(kw_only=True)
class ValidationConfig:
    """Validation passes during training."""

    eval_iters: int | None = 100
    """Validation iterations per evaluation."""
    eval_interval: int | None = None
    """Run validation every this many iterations (None: never)."""
    eval_global_batch_size: int | None = None
    """Samples per validation iteration; None means train.global_batch_size."""
    eval_micro_batch_size: int | None = None
    """Samples per validation microbatch; None means train.micro_batch_size."""
    skip_train: bool = False
    """Only validate, never train (not supported yet: False)."""


@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate schedule with Megatron's OptimizerParamScheduler semantics.

    Iteration fields (``*_iters``) or sample fields (``*_samples``), never both; validate turns
    them into the ``*_steps`` the scheduler counts (in samples).
    """

    lr_decay_style: str = "linear"
    """constant, linear or cosine."""
    lr_wsd_decay_style: str = "exponential"
    """Decay shape of the WSD schedule (WSD is not supported yet)."""
    lr_decay_iters: int | None = None
    """Iterations to decay over; None means train_iters."""
    lr_decay_samples: int | None = None
    """Samples to decay over (sample-based training); None means train_samples."""
    lr_wsd_decay_iters: int | None = None
    """Iterations of WSD decay."""
    lr_wsd_decay_samples: int | None = None
    """Samples of WSD decay."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay steps (instead of lr_warmup_iters / _samples)."""
    lr_warmup_iters: int = 0
    """Linear warmup iterations."""
    lr_warmup_samples: int = 0
    """Linear warmup samples (sample-based training)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of warmup."""
    override_opt_param_scheduler: bool = False
    """On resume, keep this run's schedule values where the checkpoint's differ."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, take the schedule values from the checkpoint."""
    start_weight_decay: float | None = None
    """Weight decay at the start of a linear or cosine increment (needs end_weight_decay)."""
    end_weight_decay: float | None = None
    """Weight decay at its end; with the constant style, the weight decay throughout (None:
    optimizer.weight_decay)."""
    weight_decay_incr_style: str = "constant"
    """Weight decay from start to end over the run: constant, linear or cosine."""
    max_steps: int | None = None
    """Schedule as if training ran this many iterations (>= train_iters), for shortened runs."""
    lr_decay_steps: int | None = field(default=None, init=False)
    """Derived by validate: decay length in samples."""
    lr_warmup_steps: float | None = field(default=None, init=False)
    """Derived by validate: warmup length in samples."""
    wd_incr_steps: int | None = field(default=None, init=False)
    """Derived by validate: weight-decay increment length in samples."""
    wsd_decay_steps: int | None = field(default=None, init=False)
    """Derived by validate: WSD decay length in samples."""

    def finalize(self) -> None:
        if self.max_steps is not None and self.max_steps <= 0:
            raise ConfigError(
                "scheduler.max_steps", f"scheduler.max_steps must be positive, got {self.max_steps}."
            )
        if self.start_weight_decay is not None:
            require(
                self.start_weight_decay >= 0.0,
                "--start-weight-decay",
                "start_weight_decay should be positive.",
            )
            require(
                self.end_weight_decay is not None and self.end_weight_decay >= self.start_weight_decay,
                "--end-weight-decay",
                "end_weight_decay must be >= start_weight_decay",
            )
        require(
            self.weight_decay_incr_style in ("constant", "linear", "cosine"),
            "--weight-decay-incr-style",
            f"must be constant, linear or cosine, got {self.weight_decay_incr_style!r}",
        )
        if self.weight_decay_incr_style == "constant":
            require(
                None in (self.start_weight_decay, self.end_weight_decay)
                or self.start_weight_decay == self.end_weight_decay,
                "--end-weight-decay",
                "a constant weight decay (--weight-decay-incr-style constant) needs "
                f"--start-weight-decay ({self.start_weight_decay}) == --end-weight-decay ({self.end_weight_decay})",
            )
        else:
            require(
                self.start_weight_decay is not None and self.end_weight_decay is not None,
                "--weight-decay-incr-style",
                f"{self.weight_decay_incr_style} needs --start-weight-decay and --end-weight-decay",
            )
        require(
            not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
            "override_opt_param_scheduler",
            "both override and use-checkpoint are set.",
        )
        iters = (
            self.lr_decay_iters is not None
            or self.lr_warmup_iters != 0
            or self.lr_wsd_decay_iters is not None
        )
        samples = (
            self.lr_decay_samples is not None
            or self.lr_warmup_samples != 0
            or self.lr_wsd_decay_samples is not None
        )
        require(
            not (iters and samples),
            "--lr-decay-samples",
            "Cannot mix iteration-based and sample-based scheduler fields; use either the *_iters "
            "or the *_samples fields",
        )
        if self.lr_warmup_fraction is not None:
            require(
                self.lr_warmup_iters == 0 and self.lr_warmup_samples == 0,
                "--lr-warmup-fraction",
                f"Cannot specify lr_warmup_fraction={self.lr_warmup_fraction} with "
                f"lr_warmup_iters={self.lr_warmup_iters} or lr_warmup_samples={self.lr_warmup_samples}",
            )


def check_schedule_mode(t: TrainingConfig, s: SchedulerConfig) -> None:
    """Sample-based training takes the *_samples scheduler fields, iteration-based the *_iters ones."""
    if t.train_samples is not None:
        require(
            s.max_steps is None,
            "scheduler.max_steps",
            "scheduler.max_steps is only supported for iteration-based training; "
            "use sample-based scheduler fields with train_samples",
        )
        require(
            s.lr_decay_iters is None,
            "--lr-decay-iters",
            "Use lr_decay_samples for sample-based training, not lr_decay_iters",
        )
        require(
            s.lr_warmup_iters == 0,
            "--lr-warmup-iters",
            "Use lr_warmup_samples for sample-based training, not lr_warmup_iters",
        )
    else:
        require(
            s.lr_decay_samples is None,
            "--lr-decay-samples",
            "Use lr_decay_iters for iteration-based training, not lr_decay_samples",
        )
        require(
            s.lr_warmup_samples == 0,
            "--lr-warmup-samples",
            "Use lr_warmup_iters for iteration-based training, not lr_warmup_samples",
        )


def derive_scheduler_steps(t: TrainingConfig, s: SchedulerConfig) -> None:
    """Fill the scheduler's *_steps (counted in samples) from its *_iters or *_samples fields."""
    if t.train_samples is not None:
        if s.lr_decay_samples is None:
            s.lr_decay_samples = t.train_samples
        s.lr_decay_steps = s.lr_decay_samples
        s.wd_incr_steps = t.train_samples
        if s.lr_wsd_decay_samples is not None:
            s.wsd_decay_steps = s.lr_wsd_decay_samples
        warmup = s.lr_warmup_samples
    else:
        if s.max_steps is not None:
            if s.max_steps < t.train_iters:
                raise ConfigError(
                    "scheduler.max_steps",
                    f"scheduler.max_steps ({s.max_steps}) must be greater than or equal to "
                    f"train.train_iters ({t.train_iters}).",
                )
            s.lr_decay_iters = s.max_steps
        elif s.lr_decay_iters is None:
            s.lr_decay_iters = t.train_iters
        gbs = t.global_batch_size
        s.lr_decay_steps = s.lr_decay_iters * gbs
        s.wd_incr_steps = (s.max_steps or t.train_iters) * gbs
        if s.lr_wsd_decay_iters is not None:
            s.wsd_decay_steps = s.lr_wsd_decay_iters * gbs
        warmup = s.lr_warmup_iters * gbs
    if s.lr_warmup_fraction is not None:
        warmup = s.lr_warmup_fraction * s.lr_decay_steps
    s.lr_warmup_steps = warmup
    if s.lr_decay_steps <= 0:
        raise ConfigError(
            "--train-iters",
            f"lr_decay_steps must be > 0, got {s.lr_decay_steps}; raise train_iters/train_samples "
            "or lr_decay_iters/lr_decay_samples",
        )
    if s.lr_warmup_steps >= s.lr_decay_steps:
        warnings.warn(
            f"lr_warmup_steps ({s.lr_warmup_steps}) >= lr_decay_steps ({s.lr_decay_steps}); "
            f"capping lr_warmup_steps to {s.lr_decay_steps - 1}.",
            UserWarning,
            stacklevel=2,
        )
        s.lr_warmup_steps = s.lr_decay_steps - 1
