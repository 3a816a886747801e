"""The training loop: train(), train_step(), training_log() and evaluate()."""

from __future__ import annotations

import contextlib
import math
import time
from datetime import datetime

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.core.pipeline_parallel import get_forward_backward_func
from megatron_lite.training import checkpointing
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.eval import evaluate_and_print_results
from megatron_lite.training.state import GlobalState
from megatron_lite.training.utils.activation_memory import ACTIVATION_MEMORY
from megatron_lite.training.utils.metrics_writer import MetricsWriter
from megatron_lite.training.utils.sig_utils import DistributedSignalHandler
from megatron_lite.training.utils.train_utils import (
    device_memory_capacity_gigabytes,
    format_memory_line,
    gather_memory_across_pp_group,
    mean_over_dp,
    print_rank_last,
    reduce_max_memory_across_pp_group,
    report_memory,
)

ADVANCED, SKIPPED, NAN = "advanced iterations", "skipped iterations", "nan iterations"


def _loggers_configured(config: ConfigContainer) -> bool:
    """Whether any sink is configured: the same answer on every rank, unlike 'does my rank log'."""
    lg = config.logger
    return bool(lg.tensorboard_dir or lg.wandb_project or lg.mlflow_experiment or lg.comet_project)


def train_step(
    forward_step_func,
    data_iterator,
    model,
    optimizer,
    scheduler,
    config: ConfigContainer,
    timers,
    pg_collection,
):
    """One global batch: forward/backward over all microbatches, then one optimizer step."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func(config.model.pipeline_model_parallel_size)
    timers("forward-backward", log_level=1).start()
    with ACTIVATION_MEMORY.track():
        losses = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=config.num_microbatches,
            seq_length=config.dataset.sequence_length,
            micro_batch_size=config.train.micro_batch_size,
            pg_collection=pg_collection,
        )
    timers("forward-backward").stop()
    timers("optimizer", log_level=1).start()
    update_successful, grad_norm, num_zeros = optimizer.step()
    timers("optimizer").stop()
    if update_successful:
        scheduler.step(increment=config.train.global_batch_size)
    # Loss stays a tensor (this rank's mean over its microbatches) until log time.
    loss_dict = {key: torch.stack([x[key] for x in losses]).mean() for key in (losses[0] if losses else {})}
    return loss_dict, int(not update_successful), grad_norm, num_zeros


def _memory_metrics(lg, pp_group) -> tuple[dict[str, float], dict]:
    """This rank's report and the ``memory/*`` metrics: every key's max over the pipeline stages, and
    with --log-memory-per-pp-stage each stage's own value. Collective over ``pp_group``."""
    local_report = report_memory(lg.memory_keys)
    metrics: dict[str, float] = {}
    if lg.log_memory_per_pp_stage:
        peak, stages = gather_memory_across_pp_group(local_report, pp_group)
        for stage, report in enumerate(stages):
            metrics.update({f"memory/pp-stage-{stage}/{k}": v for k, v in report.items()})
    else:
        peak = reduce_max_memory_across_pp_group(local_report, pp_group)
    metrics.update({f"memory/{k}": v for k, v in peak.items()})
    if (capacity := device_memory_capacity_gigabytes()) is not None:
        metrics["memory/capacity-gigabytes"] = capacity
    return metrics, local_report


def _iteration_line(
    config, ts, learning_rate, loss_scale, grad_norm, params_norm, per_iter, interval_losses, counts
) -> str:
    """Megatron's console line for the interval ending at this iteration."""
    tokens_per_s = (
        config.train.global_batch_size * config.dataset.sequence_length / per_iter if per_iter else 0.0
    )
    line = (
        f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] iteration {ts.step:8d}/{config.train.train_iters:8d} |"
        f" consumed samples: {ts.consumed_train_samples:12d} |"
        f" elapsed time per iteration (ms): {per_iter * 1000.0:.1f} |"
        f" throughput (tokens/s): {tokens_per_s:.1f} |"
        f" learning rate: {learning_rate:.6E} |"
        f" global batch size: {config.train.global_batch_size:5d} |"
    )
    for key, total in interval_losses.items():
        avg = total / max(1, counts[ADVANCED])
        if avg > 0.0:
            line += f" {key}: {avg:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    return line + (
        f" number of skipped iterations: {counts[SKIPPED]:3d} | number of nan iterations: {counts[NAN]:3d} |"
    )


def training_log(
    loss_dict,
    total_loss_dict,
    learning_rate,
    loss_scale,
    report_memory_flag,
    skipped_iter,
    grad_norm,
    params_norm,
    num_zeros_in_grad,
    config: ConfigContainer,
    global_state: GlobalState,
    pg_collection,
) -> bool:
    """Log one iteration. Call on every rank: the memory reduction and the loss reduction below are
    collectives, gated only by config and iteration. Returns the new report_memory_flag."""
    lg, ts, timers = config.logger, global_state.train_state, global_state.timers
    iteration = ts.step

    # Interval bookkeeping (a NaN loss is only checked on skipped iterations, as in Megatron).
    total_loss_dict[ADVANCED] = total_loss_dict.get(ADVANCED, 0) + (1 - skipped_iter)
    total_loss_dict[SKIPPED] = total_loss_dict.get(SKIPPED, 0) + skipped_iter
    got_nan = skipped_iter and any(not math.isfinite(v.item()) for v in loss_dict.values())
    total_loss_dict[NAN] = total_loss_dict.get(NAN, 0) + int(got_nan)
    if not skipped_iter:
        for key, value in loss_dict.items():
            total_loss_dict[key] = (
                total_loss_dict[key] + value.double() if key in total_loss_dict else value.double()
            )

    # 1. Memory: collective over the pipeline group, on every stage, before any writer check.
    tb_step = iteration % lg.tensorboard_log_interval == 0
    metrics, local_report = (
        _memory_metrics(lg, pg_collection.pp) if lg.log_memory_to_tensorboard and tb_step else ({}, None)
    )

    # 2. Loss: one data-parallel reduction per logged step, on the stage that holds the loss.
    console_step = iteration % lg.log_interval == 0
    loss_keys = [k for k in total_loss_dict if k not in (ADVANCED, SKIPPED, NAN)]
    current, interval = {}, {}
    last_stage = dist.get_rank(pg_collection.pp) == dist.get_world_size(pg_collection.pp) - 1
    if last_stage and (console_step or (tb_step and _loggers_configured(config))):
        keys = list(loss_dict)
        reduced = mean_over_dp(
            [loss_dict[k] for k in keys] + [total_loss_dict[k] for k in loss_keys], pg_collection.dp_cp
        )
        current, interval = dict(zip(keys, reduced)), dict(zip(loss_keys, reduced[len(keys) :]))

    # 3. Write: only the last rank has loggers; on every other rank the writer has no sinks.
    writer = MetricsWriter.from_state(global_state)
    loggers_exist = bool(writer)
    if loggers_exist and tb_step:
        metrics.update(
            {"learning-rate": learning_rate, "batch-size": config.train.global_batch_size, **current}
        )
        if lg.log_loss_scale_to_tensorboard:
            metrics["loss-scale"] = loss_scale
        if grad_norm is not None and math.isfinite(grad_norm):
            metrics["grad-norm"] = grad_norm
        if params_norm is not None:
            metrics["params-norm"] = params_norm
        if lg.log_timers_to_tensorboard:
            spent = timers.elapsed_times(["forward-backward", "optimizer"], reset=True)
            metrics.update({f"{name}-time": seconds for name, seconds in spent.items()})
        if lg.log_throughput and global_state.last_iteration_time:
            tokens = config.train.global_batch_size * config.dataset.sequence_length
            metrics["throughput"] = tokens / global_state.last_iteration_time
        writer.write(metrics, iteration)

    if console_step:
        per_iter = timers("interval-time").elapsed(reset=True) / max(
            1, total_loss_dict[ADVANCED] + total_loss_dict[SKIPPED]
        )
        print_rank_last(
            _iteration_line(
                config,
                ts,
                learning_rate,
                loss_scale,
                grad_norm,
                params_norm,
                per_iter,
                interval,
                total_loss_dict,
            )
        )
        total_loss_dict.clear()
        if report_memory_flag:
            # Every stage prints its own line (data-parallel rank 0), so the console shows each stage.
            if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
                report = local_report or report_memory(lg.memory_keys)
                print(format_memory_line(dist.get_rank(), iteration, report), flush=True)
            report_memory_flag = False
    return report_memory_flag


def train(forward_step_func, setup_output) -> None:
    """Run iterations until train_iters, exit_interval or an agreed SIGTERM; save as configured."""
    s = setup_output
    state, config = s.state, s.state.cfg
    ts, timers, ckpt = state.train_state, state.timers, config.checkpoint
    total_loss_dict: dict = {}
    report_memory_flag = True
    handler = DistributedSignalHandler() if config.train.exit_signal_handler else contextlib.nullcontext()
    last_saved = ts.step if ckpt.load else -1

    def save() -> None:
        nonlocal last_saved
        if ckpt.save and last_saved != ts.step:
            checkpointing.save_checkpoint(state, s.model, s.optimizer, s.scheduler, s.pg_collection)
            last_saved = ts.step

    with handler:
        timers("interval-time", log_level=0).start()
        while ts.step < config.train.train_iters:
            start = time.perf_counter()
            loss_dict, skipped, grad_norm, num_zeros = train_step(
                forward_step_func,
                s.train_data_iterator,
                s.model,
                s.optimizer,
                s.scheduler,
                config,
                timers,
                s.pg_collection,
            )
            ts.step += 1
            ts.consumed_train_samples += config.train.global_batch_size
            ts.skipped_train_samples += skipped * config.train.global_batch_size
            state.last_iteration_time = time.perf_counter() - start
            params_norm = s.optimizer.get_params_norm() if config.logger.log_params_norm else None
            report_memory_flag = training_log(
                loss_dict,
                total_loss_dict,
                s.optimizer.param_groups[0]["lr"],
                s.optimizer.get_loss_scale().item(),
                report_memory_flag,
                skipped,
                grad_norm,
                params_norm,
                num_zeros,
                config,
                state,
                s.pg_collection,
            )
            if (
                config.train.eval_interval
                and ts.step % config.train.eval_interval == 0
                and s.valid_data_iterator
            ):
                evaluate_and_print_results(
                    forward_step_func, s.valid_data_iterator, s.model, config, state, s.pg_collection
                )
            if ckpt.save_interval and ts.step % ckpt.save_interval == 0:
                save()
            if config.train.exit_signal_handler and handler.signals_received():
                print_rank_last(f" exiting program after receiving SIGTERM at iteration {ts.step}")
                save()
                return
            if config.train.exit_interval and ts.step % config.train.exit_interval == 0:
                print_rank_last(f" exiting program at iteration {ts.step}")
                break
        save()
