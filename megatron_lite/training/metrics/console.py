"""The console side of training_log: the interval's loss totals and counters, the timers each
timing level logs, and Megatron's lines (the iteration line is read from the step's metrics, the
same dict the dashboards get)."""

from __future__ import annotations

import math
from datetime import datetime

import torch

from megatron_lite.training.metrics.step_metrics import StepMetrics

ADVANCED, SKIPPED, NAN = "advanced iterations", "skipped iterations", "nan iterations"
"""total_loss_dict's counters beside the losses (upstream's keys)."""

# Upstream's timer names per timing level; timers this loop never creates are absent from the report.
_LEVEL_1_TIMERS = [
    "forward-backward",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "all-grads-sync",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
]
_LEVEL_2_TIMERS = [
    "batch-generator",
    "forward-compute",
    "backward-compute",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-forward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
]


def timer_names(level: int) -> list[str]:
    """The timers logged at ``timing_log_level`` ``level`` (none below 1)."""
    return (_LEVEL_1_TIMERS if level >= 1 else []) + (_LEVEL_2_TIMERS if level >= 2 else [])


def accumulate_losses(total_loss_dict: dict, loss_dict: dict, skipped_iter: int) -> None:
    """Interval bookkeeping: advanced/skipped/NaN counts, and the losses of advanced iterations (a
    NaN is only looked for on skipped ones, where the update was refused)."""
    total_loss_dict[ADVANCED] = total_loss_dict.get(ADVANCED, 0) + (0 if skipped_iter else 1)
    total_loss_dict[SKIPPED] = total_loss_dict.get(SKIPPED, 0) + skipped_iter
    got_nan = False
    for key, value in loss_dict.items():
        if not skipped_iter:
            total_loss_dict[key] = (
                total_loss_dict[key] + value if key in total_loss_dict else value.detach().clone()
            )
        else:
            got_nan = got_nan or not math.isfinite(value.float().sum().item())
    total_loss_dict[NAN] = total_loss_dict.get(NAN, 0) + int(got_nan)


# The line's optional fields: (metric, label, format).
_OPTIONAL = (
    ("grad-norm", "grad norm", ".3f"),
    ("num-zeros", "num zeros", ""),
    ("params-norm", "params norm", ".3f"),
    ("max-attention-logit", "max attention logit", ".3f"),
)


def iteration_line(
    config, global_state, metrics: StepMetrics, total_loss_dict: dict, show_throughput: bool
) -> str:
    """Megatron's console line for the interval ending now, from the step's ``metrics``; resets the
    interval's totals (the losses shown are the interval's averages, not the step's)."""
    ts = global_state.train_state
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    line += f" iteration {ts.step:8d}/{config.train.train_iters:8d} |"
    line += f" consumed samples: {ts.consumed_train_samples:12d} |"
    if ts.skipped_train_samples > 0:
        line += f" skipped samples: {ts.skipped_train_samples:12d} |"
    line += f" elapsed time per iteration (ms): {metrics['iteration-time'] * 1000.0:.1f} |"
    if show_throughput and "throughput/tflops/device" in metrics:
        line += f" throughput per GPU (TFLOP/s/GPU): {metrics['throughput/tflops/device']:.1f} |"
    if "iter-energy/gpu" in metrics:
        line += f" energy per GPU (J/iter/GPU): {metrics['iter-energy/gpu']:.1f} |"
        line += f" power per GPU (W/GPU): {metrics['power/gpu']:.1f} |"
    if "learning-rate" in metrics:
        line += f" learning rate: {metrics['learning-rate']:.6E} |"
    line += f" global batch size: {metrics['batch-size']:5d} |"
    for key in list(total_loss_dict):
        if key in (ADVANCED, SKIPPED, NAN):
            continue
        avg = total_loss_dict[key].item() / float(max(1, total_loss_dict[ADVANCED]))
        if avg >= 0.0:
            line += f" {key}: {avg:.6E} |"
        total_loss_dict[key] = torch.zeros_like(total_loss_dict[key])
    line += f" loss scale: {metrics['loss-scale']:.1f} |"
    for key, label, form in _OPTIONAL:
        if key in metrics:
            line += f" {label}: {metrics[key]:{form}} |"
    line += f" number of skipped iterations: {total_loss_dict[SKIPPED]:3d} |"
    line += f" number of nan iterations: {total_loss_dict[NAN]:3d} |"
    total_loss_dict.update({ADVANCED: 0, SKIPPED: 0, NAN: 0})
    return line


def step_time_line(per_iteration: float, per_rank_tflops: float, tokens_per_step) -> str:
    """Upstream's line on CUDA; on the CPU no GPU is used, so it says what is true there: tokens per
    second and model TFLOP/s per rank."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"Step Time : {per_iteration:.2f}s GPU utilization: {per_rank_tflops:.1f}MODEL_TFLOP/s/GPU"
    if not isinstance(tokens_per_step, (int, float)):  # a config without a sequence length (a stand-in)
        return f"Step Time : {per_iteration:.2f}s model {per_rank_tflops:.3f} TFLOP/s per rank (CPU)"
    return (
        f"Step Time : {per_iteration:.2f}s throughput: {tokens_per_step / per_iteration:.0f} tokens/s, "
        f"model {per_rank_tflops:.3f} TFLOP/s per rank (CPU)"
    )
