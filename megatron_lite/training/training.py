"""The training loop: train() and train_step(); training_log is upstream's, from train_utils."""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch.distributed as dist

from megatron_lite.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator
from megatron_lite.core.pipeline_parallel import get_forward_backward_func
from megatron_lite.training import checkpointing
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.eval import evaluate_and_print_results
from megatron_lite.training.forward_step_func_types import prepare_forward_step_func
from megatron_lite.training.memory.allocated import ALLOCATED_MEMORY
from megatron_lite.training.memory.pipeline import memory_metrics
from megatron_lite.training.memory.predict.stages import predict_memory_per_stage, predicted_memory_metrics
from megatron_lite.training.memory.saved_tensors import ACTIVATION_MEMORY
from megatron_lite.training.memory.snapshots import dump_memory_snapshot
from megatron_lite.training.metrics import MetricsWriter
from megatron_lite.training.metrics.moe import moe_metrics
from megatron_lite.training.profiling import (
    handle_profiling_step,
    handle_profiling_stop,
    initialize_pytorch_profiler,
    should_profile_rank,
)
from megatron_lite.training.utils.flop_utils import num_floating_point_operations
from megatron_lite.training.utils.loss_reduction import accumulate_loss_reports, reduce_loss_reports
from megatron_lite.training.utils.train_utils import print_rank_last, training_log

__all__ = ["train", "train_step", "training_log"]


def train_step(
    forward_step_func,
    data_iterator,
    model,
    optimizer,
    scheduler,
    config: ConfigContainer,
    timers,
    pg_collection,
    *,
    track_activation_memory: bool | None = None,
):
    """One global batch: forward/backward over all microbatches, then one optimizer step.

    ``track_activation_memory``: count the tensors saved for backward (ACTIVATION_MEMORY) and, on the
    CPU, every tensor's bytes, temporaries included (ALLOCATED_MEMORY; CUDA's allocator counts its
    own); default: when memory is logged (--log-memory-to-tensorboard). train() also tracks the
    iterations of the console memory line and the first two."""
    if track_activation_memory is None:
        track_activation_memory = config.logger.log_memory_to_tensorboard
    on_cpu = next(model[0].parameters()).device.type == "cpu"
    with ALLOCATED_MEMORY.track(enabled=track_activation_memory and on_cpu):
        return _train_step(
            forward_step_func, data_iterator, model, optimizer, scheduler, config, timers, pg_collection,
            track_activation_memory,
        )  # fmt: skip


def _train_step(
    forward_step_func, data_iterator, model, optimizer, scheduler, config, timers, pg_collection, track
):
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    m = config.model
    forward_backward = get_forward_backward_func(
        m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    )
    timers("forward-backward", log_level=1).start()
    with ACTIVATION_MEMORY.track(enabled=track):
        losses = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=config.num_microbatches,
            seq_length=config.model.seq_length,
            micro_batch_size=config.train.micro_batch_size,
            pg_collection=pg_collection,
        )
    timers("forward-backward").stop()
    timers("optimizer", log_level=1).start()
    update_successful, grad_norm, num_zeros = optimizer.step()
    timers("optimizer").stop()
    if update_successful:
        scheduler.step(increment=config.train.global_batch_size)
    return (
        reduce_loss_reports(accumulate_loss_reports({}, losses), pg_collection.dp_cp),
        int(not update_successful),
        grad_norm,
        num_zeros,
    )


def _tracks_memory(lg, iteration: int, loaded_iteration: int, report_memory_flag: bool) -> bool:
    """Whether ``iteration``'s memory is reported (to the loggers, or on the console memory line), or
    it is one of the first two since start, where the optimizer state materialises."""
    if not (lg.log_memory_to_tensorboard or report_memory_flag):
        return False
    logged = lg.log_memory_to_tensorboard and iteration % lg.tensorboard_log_interval == 0
    printed = report_memory_flag and iteration % lg.log_interval == 0
    return logged or printed or iteration <= loaded_iteration + 2


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def train(forward_step_func, setup_output) -> None:
    """Run iterations until train_iters, exit_interval or an agreed SIGTERM; save as configured."""
    s = setup_output
    # Once: a step taking the state first (Megatron-Bridge style) gets it bound here.
    forward_step_func = prepare_forward_step_func(forward_step_func, s.state)
    state, config = s.state, s.state.cfg
    ts, timers, ckpt = state.train_state, state.timers, config.checkpoint
    total_loss_dict: dict = {}
    report_memory_flag = True
    handler = contextlib.nullcontext()  # the SIGTERM trap is state.signal_handler, set with the config
    last_saved = ts.step if ckpt.load else -1
    loaded_iteration = ts.step
    # Wall-clock end times of the latest iterations, for the windowed throughput report.
    history_wct: deque[float] = deque(maxlen=getattr(config.logger, "throughput_window_size", 100) + 1)
    reconfigure_num_microbatches_calculator(
        dist.get_rank(),
        None,
        config.train.global_batch_size,
        config.train.micro_batch_size,
        config.data_parallel_size,
    )

    def save() -> None:
        nonlocal last_saved
        if ckpt.save and last_saved != ts.step:
            checkpointing.save_checkpoint(state, s.model, s.optimizer, s.scheduler, s.pg_collection)
            last_saved = ts.step

    if ckpt.save and ckpt.async_save:
        checkpointing.start_async_writer()
    prof_config, rank = config.profiling, dist.get_rank()
    prof, nsys_context = None, None
    if should_profile_rank(prof_config, rank) and prof_config.use_pytorch_profiler:
        prof = initialize_pytorch_profiler(prof_config, config.logger.tensorboard_dir)
        prof.start()
    if config.logger.log_memory_to_tensorboard and (writer := MetricsWriter.from_state(state)):
        # A pure function of the config: the writer logs it alone, no collective. Its per-stage
        # measurements come from its own pipeline, so the prediction is for its dp x cp rank.
        device_type = next(s.model[0].parameters()).device.type
        predicted = predict_memory_per_stage(config, _rank(s.pg_collection.dp_cp), device_type)
        writer.write(predicted_memory_metrics(predicted), ts.step)
    with handler:
        timers("interval-time", log_level=0).start()
        while ts.step < config.train.train_iters:
            nsys_context = handle_profiling_step(prof_config, ts.step, rank, prof) or nsys_context
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
                # Only the reported iterations (and the first two) pay for the memory trackers.
                track_activation_memory=_tracks_memory(
                    config.logger, ts.step + 1, loaded_iteration, report_memory_flag
                ),
            )
            ts.step += 1
            ts.consumed_train_samples += config.train.global_batch_size
            ts.skipped_train_samples += skipped * config.train.global_batch_size
            ts.floating_point_operations_so_far += num_floating_point_operations(
                config, config.train.global_batch_size
            )
            state.last_iteration_time = time.perf_counter() - start
            history_wct.append(time.time() - state.start_time)
            params_norm = s.optimizer.get_params_norm() if config.logger.log_params_norm else None
            # Memory: collective over the pipeline group on EVERY PP rank, here, before training_log's
            # loggers_exist-gated block (only the last rank has loggers; the peak is on stage 0).
            # MoE: first the max over the expert-parallel ranks of the stage (they differ by routing).
            memory_report = memory_metrics(
                config.logger, ts.step, s.pg_collection.pp, ep_group=s.pg_collection.ep
            )
            # MoE: every rank; on logged iterations collective over pp, the sequence split and dp.
            moe_report = moe_metrics(config, s.pg_collection, config.num_microbatches, ts.step)
            report_memory_flag = training_log(
                loss_dict,
                total_loss_dict,
                s.optimizer.param_groups[0]["lr"],
                None,  # decoupled learning rate: not supported
                s.optimizer.get_loss_scale().item(),
                report_memory_flag,
                skipped,
                grad_norm,
                params_norm,
                num_zeros,
                config,
                state,
                history_wct,
                s.model,
                pg_collection=s.pg_collection,
                loaded_iteration=loaded_iteration,
                memory_report=memory_report,
                moe_report=moe_report,
            )
            handle_profiling_stop(prof_config, ts.step, rank, prof, nsys_context)
            if (
                prof_config is not None
                and prof_config.record_memory_history
                and ts.step % config.logger.log_interval == 0
                and rank == dist.get_world_size() - 1  # as upstream: the last rank's history
            ):
                dump_memory_snapshot(prof_config.memory_snapshot_path)
            if (
                config.validation.eval_interval
                and config.validation.eval_iters > 0  # --eval-iters 0: no validation, as upstream
                and ts.step % config.validation.eval_interval == 0
                and s.valid_data_iterator
            ):
                evaluate_and_print_results(
                    forward_step_func, s.valid_data_iterator, s.model, config, state, s.pg_collection
                )
            # A background save (--async-save) becomes the latest checkpoint once every rank wrote it.
            checkpointing.finalize_async_save(blocking=False)
            if ckpt.save_interval and ts.step % ckpt.save_interval == 0:
                save()
            if config.train.exit_signal_handler and any(state.signal_handler.signals_received()):
                print_rank_last(f" exiting program after receiving SIGTERM at iteration {ts.step}")
                save()
                checkpointing.finalize_async_save(blocking=True)
                return
            if config.train.exit_interval and ts.step % config.train.exit_interval == 0:
                print_rank_last(f" exiting program at iteration {ts.step}")
                break
        save()
        checkpointing.finalize_async_save(blocking=True)
