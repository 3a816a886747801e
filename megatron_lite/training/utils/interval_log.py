"""The console side of training_log: the interval's loss totals and counters, the timers each
timing level logs, and Megatron's iteration line."""

from __future__ import annotations

import math
from datetime import datetime

import torch

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


def iteration_line(
    config,
    global_state,
    per_iteration,
    per_gpu_tf,
    energy,
    learning_rate,
    batch_size,
    total_loss_dict,
    loss_scale,
    grad_norm,
    num_zeros_in_grad,
    params_norm,
    max_attention_logit,
) -> str:
    """Megatron's console line for the interval ending now; resets the interval's totals."""
    ts = global_state.train_state
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    line += f" iteration {ts.step:8d}/{config.train.train_iters:8d} |"
    line += f" consumed samples: {ts.consumed_train_samples:12d} |"
    if ts.skipped_train_samples > 0:
        line += f" skipped samples: {ts.skipped_train_samples:12d} |"
    line += f" elapsed time per iteration (ms): {per_iteration * 1000.0:.1f} |"
    if per_gpu_tf is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {per_gpu_tf:.1f} |"
    line += energy
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {batch_size:5d} |"
    for key in list(total_loss_dict):
        if key in (ADVANCED, SKIPPED, NAN):
            continue
        avg = total_loss_dict[key].item() / float(max(1, total_loss_dict[ADVANCED]))
        if avg >= 0.0:
            line += f" {key}: {avg:.6E} |"
        total_loss_dict[key] = torch.zeros_like(total_loss_dict[key])
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros_in_grad is not None:
        line += f" num zeros: {num_zeros_in_grad} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    if max_attention_logit is not None:
        line += f" max attention logit: {max_attention_logit:.3f} |"
    line += f" number of skipped iterations: {total_loss_dict[SKIPPED]:3d} |"
    line += f" number of nan iterations: {total_loss_dict[NAN]:3d} |"
    total_loss_dict.update({ADVANCED: 0, SKIPPED: 0, NAN: 0})
    return line
