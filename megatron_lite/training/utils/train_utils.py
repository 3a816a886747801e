"""Upstream's training-loop helpers: training_log, the throughput/runtime/grad-norm reports and
parameter norms; the memory reports and forward-step state injection are re-exported from their
own modules (training/memory/, forward_step_func_types), where upstream keeps them here.

Module-level names (``get_num_microbatches``, ``print_rank_last``, ``report_memory``, ...) are looked
up at call time, as upstream's, so code and tests written against upstream can patch them here.
"""

from __future__ import annotations

import time

import torch
import torch.distributed

from megatron_lite.core.num_microbatches_calculator import get_num_microbatches
from megatron_lite.core.transformer.moe.moe_utils import track_moe_metrics
from megatron_lite.core.utils import get_collective_device
from megatron_lite.training.forward_step_func_types import (
    maybe_inject_state,
    needs_global_state_injection,
    prepare_forward_step_func,
)
from megatron_lite.training.memory.keys import (
    ACTIVATION_MEMORY_KEYS,
    CUDA_EXTRA_MEMORY_KEYS,
    HOST_MEMORY_KEYS,
    MEMORY_KEYS,
)
from megatron_lite.training.memory.pipeline import (
    gather_memory_across_pp_group,
    memory_metrics,
    reduce_max_memory_across_pp_group,
)
from megatron_lite.training.memory.predict.estimate import report_theoretical_memory
from megatron_lite.training.memory.report import (
    default_memory_keys,
    device_memory_capacity_gigabytes,
    format_memory_line,
    report_memory,
)
from megatron_lite.training.memory.saved_tensors import ACTIVATION_MEMORY
from megatron_lite.training.metrics import LOSSES, TFLOPS, TIMERS, MetricsWriter, StepMetrics
from megatron_lite.training.metrics.console import (
    ADVANCED,
    SKIPPED,
    accumulate_losses,
    iteration_line,
    step_time_line,
    timer_names,
)
from megatron_lite.training.metrics.moe import upstream_moe_logging
from megatron_lite.training.metrics.timers import timer_metrics
from megatron_lite.utils.common_utils import (
    get_world_size_safe,
    print_rank_0,
    print_rank_last,
)

__all__ = [
    # Upstream's train_utils names.
    "MEMORY_KEYS",
    "calc_params_l2_norm",
    "logical_and_across_model_parallel_group",
    "maybe_inject_state",
    "needs_global_state_injection",
    "param_is_not_shared",
    "prepare_forward_step_func",
    "reduce_max_memory_across_pp_group",
    "reduce_max_stat_across_model_parallel_group",
    "report_l2_norm_grad",
    "report_memory",
    "report_runtime",
    "report_throughput",
    "training_log",
    # Ours, beside them: extra memory keys and the loop's helpers.
    "ACTIVATION_MEMORY",
    "ACTIVATION_MEMORY_KEYS",
    "CUDA_EXTRA_MEMORY_KEYS",
    "HOST_MEMORY_KEYS",
    "default_memory_keys",
    "device_memory_capacity_gigabytes",
    "format_memory_line",
    "gather_memory_across_pp_group",
    "print_rank_0",
    "print_rank_last",
    "report_theoretical_memory",
]


def get_pg_collection(model):
    """The ProcessGroupCollection the model was built with (the first chunk's), or the default one."""
    from megatron_lite.core.process_groups_config import ProcessGroupCollection

    for chunk in model if isinstance(model, list) else [model]:
        if (pgc := getattr(chunk, "pg_collection", None)) is not None:
            return pgc
    return ProcessGroupCollection.use_mpu_process_groups()


def reduce_max_stat_across_model_parallel_group(stat: float | None, mp_group) -> float | None:
    """Max of ``stat`` over ``mp_group`` where None (a rank without it) counts as absent; None when
    every rank has None. Collective over ``mp_group``."""
    value = torch.tensor([-1.0 if stat is None else float(stat)], device=get_collective_device(mp_group))
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mp_group)
    return None if value.item() == -1.0 else value.item()


def logical_and_across_model_parallel_group(input: bool, mp_group) -> bool:
    """True only if ``input`` is True on every rank of ``mp_group``. Collective over ``mp_group``."""
    value = torch.tensor([1 if input is True else 0], dtype=torch.int, device=get_collective_device(mp_group))
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=mp_group)
    return bool(value.item())


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for parameters marked ``shared`` (counted once, on another stage)."""
    return not getattr(param, "shared", False)


def param_is_not_tensor_parallel_duplicate(param, tp_group=None, expert_tp_group=None) -> bool:
    """True for a parameter that counts once across tensor-parallel ranks: a TP shard, or a replicated
    parameter on rank 0 of ``tp_group`` (of ``expert_tp_group`` for an expert parameter, one marked
    ``allreduce=False``). A missing group means no tensor parallelism."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    group = expert_tp_group if not getattr(param, "allreduce", True) else tp_group
    return group is None or group.rank() == 0


def get_data_parallel_group_if_dtensor(param, data_parallel_group=None):
    """The DTensor's data-parallel group; our parameters are plain tensors, so the given group."""
    return data_parallel_group


def to_local_if_dtensor(tensor):
    """A DTensor's local shard; our parameters are plain tensors, so the tensor itself."""
    return tensor


def calc_params_l2_norm(
    model, model_config, use_megatron_fsdp: bool = False, force_create_fp32_copy: bool = False
):
    """L2 norm of all parameters of ``model`` (a module or list of chunks) over every rank.

    Each parameter counts once: shared ones (``param.shared``) and tensor-parallel duplicates (over the
    expert TP group for expert parameters) are skipped; with bf16 the fp32 master copy
    (``param.main_param``) is used when present, unless ``force_create_fp32_copy``. Four squared sums,
    as upstream: dense and expert (``allreduce=False``) parameters, each whole or as the distributed
    optimizer's shard (``main_param_sharded``), the shards summed over data parallelism (``dp_cp``,
    ``expt_dp``). Then dense over the model-parallel group and expert over ``tp_ep_pp``. Collective
    over all four groups on every rank, with or without expert parameters. Megatron FSDP is a feature
    we do not have.
    """
    if use_megatron_fsdp:
        raise NotImplementedError("Megatron FSDP is not supported by megatron_lite")
    chunks = model if isinstance(model, list) else [model]
    pg = get_pg_collection(chunks)
    # (expert, sharded) -> tensors
    groups: dict[tuple[bool, bool], list] = {(e, s): [] for e in (False, True) for s in (False, True)}
    dp_group = None
    for chunk in chunks:
        for param in chunk.parameters():
            dp_group = get_data_parallel_group_if_dtensor(param, dp_group)
            expert = not getattr(param, "allreduce", True)
            if not param_is_not_tensor_parallel_duplicate(param, tp_group=pg.tp, expert_tp_group=pg.expt_tp):
                continue
            if expert:
                assert param_is_not_shared(param), "an expert parameter cannot be shared"
            elif not param_is_not_shared(param):
                continue
            param = to_local_if_dtensor(param)
            if not model_config.bf16:
                groups[expert, False].append(param.data)
            elif force_create_fp32_copy or not hasattr(param, "main_param"):
                groups[expert, False].append(param.data.float())
            elif getattr(param, "main_param_sharded", False):
                if param.main_param is not None:  # an empty shard on this rank
                    groups[expert, True].append(param.main_param)
            else:
                groups[expert, False].append(
                    param.main_param if param.main_param is not None else param.data.float()
                )
    device = next((t.device for ts in groups.values() for t in ts), get_collective_device(pg.mp))

    def squared(tensors) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for t in tensors:
            total += t.detach().float().pow(2).sum()
        return total

    sum_ = torch.distributed.ReduceOp.SUM
    norm_2 = squared(groups[False, False])
    if dp_group is not None:
        torch.distributed.all_reduce(norm_2, op=sum_, group=dp_group)
    sharded_2 = squared(groups[False, True])
    torch.distributed.all_reduce(sharded_2, op=sum_, group=pg.dp_cp)
    norm_2 += sharded_2
    # Every rank reduces the expert sums, with or without expert parameters (uneven MoE layers).
    moe_norm_2 = squared(groups[True, False])
    sharded_moe_2 = squared(groups[True, True])
    torch.distributed.all_reduce(sharded_moe_2, op=sum_, group=pg.expt_dp)
    moe_norm_2 += sharded_moe_2
    if torch.distributed.get_process_group_ranks(pg.mp) == torch.distributed.get_process_group_ranks(
        pg.tp_ep_pp
    ):
        norm_2 += moe_norm_2
        torch.distributed.all_reduce(norm_2, op=sum_, group=pg.mp)
    else:
        torch.distributed.all_reduce(norm_2, op=sum_, group=pg.mp)
        torch.distributed.all_reduce(moe_norm_2, op=sum_, group=pg.tp_ep_pp)
        norm_2 += moe_norm_2
    return norm_2.item() ** 0.5  # note: a CPU-GPU sync point


def report_l2_norm_grad(model) -> dict:
    """``l2_norm/grad/<name>`` for each trainable parameter's reduced gradient (``main_grad``) and
    ``l2_norm/grad/global`` over them, as floats. Call after gradients are reduced and unscaled."""
    metrics: dict = {}
    for chunk in model:
        for name, p in chunk.named_parameters():
            if p.requires_grad and p.main_grad is not None:
                metrics.setdefault(f"l2_norm/grad/{name}", torch.linalg.vector_norm(p.main_grad))
    total = sum(v**2 for v in metrics.values()) ** 0.5 if metrics else 0.0
    metrics["l2_norm/grad/global"] = total
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


_TIME_UNITS = {"seconds": 1, "minutes": 60, "hours": 3600, "days": 86400}


def report_runtime(
    train_state, start_time: float, seq_length: int, train_iters: int, time_unit: str = "seconds"
):
    """Elapsed and estimated remaining training time (in ``time_unit``) and consumed tokens, samples
    and batches, under ``time/*``. The estimate assumes the rate so far holds."""
    if time_unit not in _TIME_UNITS:
        raise ValueError(
            f'Invalid time_unit: {time_unit}. Must be one of "seconds", "minutes", "hours", or "days".'
        )
    divider = _TIME_UNITS[time_unit]
    elapsed = time.time() - start_time
    done = train_state.step / train_iters
    return {
        "time/remaining_estimate": elapsed / done * (1 - done) / divider,
        "time/tokens": train_state.consumed_train_samples * seq_length,
        "time/samples": train_state.consumed_train_samples,
        "time/batches": train_state.step,
        "time/total": elapsed / divider,
    }


def report_throughput(train_config, iteration: int, seq_length: int, history_wct: list, window_size: int):
    """Batches, samples and tokens per second (overall and per device) over the last ``window_size``
    iterations, whose wall-clock end times are ``history_wct``; {} until the window is full or when
    the times do not advance (e.g. just after a resume)."""
    if len(history_wct) < window_size:
        return {}
    elapsed_wct = history_wct[-1] - history_wct[0]
    if elapsed_wct <= 0:
        print_rank_0(
            f"Warning: elapsed_wct is {elapsed_wct}, skipping throughput calculation at iteration {iteration}"
        )
        return {}
    world_size = get_world_size_safe()
    intervals = window_size - 1  # iterations completed between the first and the last timestamp
    batches_per_sec = intervals / elapsed_wct
    samples_per_sec = intervals * train_config.global_batch_size / elapsed_wct
    metrics = {
        "throughput/batches_per_sec": batches_per_sec,
        "throughput/samples_per_sec": samples_per_sec,
        "throughput/device/batches_per_sec": batches_per_sec / world_size,
        "throughput/device/samples_per_sec": samples_per_sec / world_size,
        "throughput/micro_batch_size": train_config.micro_batch_size,
        "throughput/global_batch_size": train_config.global_batch_size,
    }
    tokens = intervals * train_config.global_batch_size * seq_length
    if tokens > 0:
        metrics["throughput/tokens_per_sec"] = tokens / elapsed_wct
        metrics["throughput/device/tokens_per_sec"] = tokens / elapsed_wct / world_size
    return metrics


def training_log(
    loss_dict,
    total_loss_dict,
    learning_rate,
    decoupled_learning_rate,
    loss_scale,
    report_memory_flag,
    skipped_iter,
    grad_norm,
    params_norm,
    num_zeros_in_grad,
    config,
    global_state,
    history_wct,
    model,
    *,
    pg_collection=None,
    log_max_attention_logit: float | None = None,
    loaded_iteration: int = 0,
    seq_length: int | None = None,
    memory_report: dict | None = None,
    moe_report: tuple[dict, str] | None = None,
) -> bool:
    """Log one iteration to the console and every sink; returns the new ``report_memory_flag``.

    One ``StepMetrics`` dict is built per call: the dashboards get its groups (training/metrics/sinks.py
    writes each sink's way) and the console line is read from it.

    Call on every rank: the learning-rate, timer and memory reductions are collectives, gated only by
    config and iteration. ``loss_dict`` holds this step's losses already averaged over data-parallel
    ranks (empty off the last pipeline stage). ``memory_report``: this step's ``memory/*`` metrics if
    the caller already reduced them over the pipeline (our loop does); None computes them here.
    ``pg_collection`` defaults to the model's. Returns False once memory was reported after the
    second iteration since ``loaded_iteration`` (so it includes the optimizer state). ``moe_report``:
    this step's MoE scalars and console text (training/metrics/moe.py), already reduced; None
    for a MoE model calls upstream's track_moe_metrics here (the auxiliary losses only).
    """
    lg, train_config, timers, train_state = (
        config.logger,
        config.train,
        global_state.timers,
        global_state.train_state,
    )
    iteration = train_state.step
    writer = MetricsWriter.from_state(global_state)
    pg_collection = pg_collection or get_pg_collection(model)
    metrics = StepMetrics(iteration, samples=train_state.consumed_train_samples)

    accumulate_losses(total_loss_dict, loss_dict, skipped_iter)
    timers_to_log = timer_names(lg.timing_log_level)
    batch_size = train_config.micro_batch_size * config.data_parallel_size * get_num_microbatches()
    total_iterations = total_loss_dict[ADVANCED] + total_loss_dict[SKIPPED]
    # Ranks without trainable parameters have no learning rate: take the model-parallel max.
    learning_rate = reduce_max_stat_across_model_parallel_group(learning_rate, mp_group=pg_collection.mp)
    tb_step = iteration % lg.tensorboard_log_interval == 0
    dashboards = bool(writer) and tb_step

    if lg.log_timers_to_tensorboard and tb_step:  # collective: one gather for every sink
        metrics.add(timer_metrics(timers, timers_to_log, total_iterations), kind=TIMERS)

    # Memory: reduced over the pipeline on EVERY rank before the writer-gated block below (only the
    # last rank has loggers, while the peak usually lives on the first stage). The loop's own code
    # path, the max only (as upstream), with this module's report and reduce (patchable here).
    if memory_report is None and lg.log_memory_to_tensorboard and tb_step:
        memory_report = memory_metrics(
            lg,
            iteration,
            pg_collection.pp,
            per_stage=False,
            report_fn=report_memory,
            reduce_fn=reduce_max_memory_across_pp_group,
        )

    # MoE: collective on every rank, every iteration. The loop passes its own report (with the
    # token counts); a caller of upstream's kind gets upstream's track_moe_metrics, which writes
    # into the step's metrics as if they were its TensorBoard writer.
    if moe_report is None and getattr(config.model, "num_moe_experts", None) is not None:
        moe_text = upstream_moe_logging(
            track_moe_metrics,
            config,
            iteration,
            metrics if writer else None,
            total_loss_dict,
            pg_collection,
            get_num_microbatches(),
        )
        moe_report = ({}, moe_text)

    if dashboards:
        seq = seq_length if seq_length is not None else _seq_length(config)
        if lg.log_throughput_to_tensorboard:
            metrics.add(
                report_throughput(
                    iteration=iteration,
                    train_config=train_config,
                    seq_length=seq,
                    history_wct=history_wct,
                    window_size=lg.throughput_window_size,
                )
            )
        if lg.log_memory_to_tensorboard and memory_report:
            metrics.add(memory_report)
        if moe_report:
            metrics.add(moe_report[0])
        if lg.log_runtime_to_tensorboard:
            start_time = getattr(global_state, "start_time", None) or time.time()
            metrics.add(
                report_runtime(train_state, start_time, seq, train_config.train_iters, lg.runtime_time_unit)
            )
        if lg.log_l2_norm_grad_to_tensorboard:
            metrics.add(report_l2_norm_grad(model))
        metrics.add({"samples vs steps": train_state.consumed_train_samples})
    # The step's scalars: the console line shows them; the dashboards on their interval, by flag.
    metrics.add({"learning-rate": learning_rate}, vs_samples=True, dashboards=dashboards)
    if config.optimizer.decoupled_lr is not None:
        metrics.add({"decoupled-learning-rate": decoupled_learning_rate}, dashboards=dashboards)
    if train_state.skipped_train_samples > 0:
        metrics.add({"skipped-train-samples": train_state.skipped_train_samples}, dashboards=dashboards)
    metrics.add({"batch-size": batch_size}, vs_samples=True, dashboards=dashboards)
    metrics.add(loss_dict, vs_samples=True, kind=LOSSES, dashboards=dashboards)
    show_loss_scale = dashboards and lg.log_loss_scale_to_tensorboard
    metrics.add({"loss-scale": loss_scale}, vs_samples=True, dashboards=show_loss_scale)
    if lg.log_world_size_to_tensorboard:
        metrics.add({"world-size": get_world_size_safe()}, vs_samples=True, dashboards=dashboards)
    for key, value in (
        ("grad-norm", grad_norm),
        ("num-zeros", num_zeros_in_grad),
        ("params-norm", params_norm),
        ("max-attention-logit", log_max_attention_logit),
    ):
        metrics.add({key: value}, vs_samples=True, dashboards=dashboards)

    if iteration % lg.log_interval == 0:
        elapsed = timers("interval-time").elapsed(barrier=True)
        per_iteration = elapsed / total_iterations
        per_gpu_tf = _interval_tflops_per_gpu(config, global_state, elapsed)
        if per_gpu_tf is not None:
            print_rank_0(step_time_line(per_iteration, per_gpu_tf, batch_size * _seq_length(config)))
            metrics.add(
                {
                    "throughput/tflops/device": per_gpu_tf,
                    "throughput/tflops": per_gpu_tf * get_world_size_safe(),
                },
                kind=TFLOPS,
                dashboards=bool(writer) and lg.log_throughput_to_tensorboard,
            )
        metrics.add(
            {"iteration-time": per_iteration}, dashboards=bool(writer) and lg.log_timers_to_tensorboard
        )
        metrics.add(_energy_metrics(global_state, total_iterations, per_iteration), dashboards=bool(writer))
        line = iteration_line(config, global_state, metrics, total_loss_dict, lg.log_throughput)
        print_rank_last(line + (moe_report[1] if moe_report else ""))
        if report_memory_flag:
            if torch.distributed.get_rank() == 0:
                report_theoretical_memory(config, num_microbatches=get_num_microbatches(), verbose=True)
            report = report_memory(lg.memory_keys)
            if torch.distributed.get_rank(group=pg_collection.dp) == 0:
                print(format_memory_line(torch.distributed.get_rank(), iteration, report), flush=True)
            # Keep reporting through the second iteration, so the line includes the optimizer state.
            if iteration > loaded_iteration + 1:
                report_memory_flag = False
        timers.log(timers_to_log, normalizer=lg.log_interval)
    writer.write_step(metrics)
    return report_memory_flag


def _seq_length(config) -> int:
    """The dataset's sequence length, else the model's (a custom DatasetProvider may have none)."""
    seq = getattr(config.dataset, "seq_length", None)
    return seq if seq is not None else config.model.seq_length


def _interval_tflops_per_gpu(config, global_state, elapsed: float) -> float | None:
    """Model TFLOP/s per GPU over this log interval: the FLOPs counted since the last log divided by
    the interval's time. None for a model without attention shapes to count FLOPs from, or when no
    FLOPs were counted (rather than a misleading 0)."""
    model = config.model
    if not (hasattr(model, "kv_channels") and hasattr(model, "num_attention_heads")):
        return None
    so_far = global_state.train_state.floating_point_operations_so_far
    so_far = so_far if isinstance(so_far, (int, float)) else 0.0
    if not so_far:
        return None  # the loop counts no FLOPs (a caller of its own): no rate to report
    previous = getattr(global_state, "_flops_at_last_log", 0.0)
    previous = previous if isinstance(previous, (int, float)) else so_far
    global_state._flops_at_last_log = so_far
    return max(so_far - previous, 0.0) / elapsed / get_world_size_safe() / 1e12


def _energy_metrics(global_state, total_iterations, per_iteration) -> dict:
    """Energy and power per GPU over the interval, when an energy monitor runs."""
    monitor = getattr(global_state, "energy_monitor", None)
    if monitor is None:
        return {}
    energy = (monitor.lap() / total_iterations) / get_world_size_safe()
    return {"iter-energy/gpu": float(energy), "power/gpu": float(energy / per_iteration)}
