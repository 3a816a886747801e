"""pretrain(): set up, train, and always close the loggers."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.setup import setup
from megatron_lite.training.state import GlobalState
from megatron_lite.training.training import train
from megatron_lite.training.utils.memory_history import (
    dump_memory_snapshot,
    oom_snapshot_path,
    start_memory_history,
)
from megatron_lite.training.utils.oom_postmortem import (
    OutOfMemoryPostMortem,
    is_out_of_memory,
    short_error,
    write_postmortem,
)
from megatron_lite.training.utils.theoretical_memory import predict_memory_per_stage
from megatron_lite.training.utils.train_utils import (
    gather_memory_across_pp_group,
    print_rank_last,
    report_memory,
)


def _print_layout(config: ConfigContainer) -> None:
    if dist.get_rank() != 0:
        return
    m = config.model
    print(
        f" megatron_lite: world {dist.get_world_size()} = tp {m.tensor_model_parallel_size} x "
        f"pp {m.pipeline_model_parallel_size} x cp {m.context_parallel_size} x "
        f"dp {parallel_state.get_data_parallel_world_size()} | backend {dist.get_backend()} | "
        f"{config.num_microbatches} microbatches of {config.train.micro_batch_size} per step",
        flush=True,
    )


# Measured key -> the prediction printed beside it in the memory table.
_PREDICTED_BESIDE = {
    "mem-max-activation-gigabytes": "activation_bytes",
    "mem-optimizer-state-gigabytes": "optimizer_state_bytes",
    "mem-weights-gigabytes": "weights_bytes",
    "mem-grads-gigabytes": "grads_bytes",
}


def _print_memory_table(config: ConfigContainer, pg_collection) -> None:
    """Each stage's final memory report, as a table on the last rank, each stage followed by a
    "predicted" row (theoretical_memory's prediction, under the measured keys it predicts).
    Collective over the pp group."""
    peak, stages = gather_memory_across_pp_group(report_memory(config.logger.memory_keys), pg_collection.pp)
    # The table shows the last rank's pipeline: predict for its dp x cp rank.
    dp_cp = pg_collection.dp_cp
    predictions = predict_memory_per_stage(config, dp_rank=0 if dp_cp is None else dist.get_rank(dp_cp))
    names = list(peak)
    header = "stage      " + "  ".join(f"{n:>28}" for n in names)
    rows = []
    for i, s in enumerate(stages):
        rows.append(f"{i:>5}      " + "  ".join(f"{s[n]:>28}" for n in names))
        predicted = [
            f"{getattr(predictions[i], _PREDICTED_BESIDE[n]) / 1e9:>28.5g}"
            if n in _PREDICTED_BESIDE
            else f"{'':>28}"
            for n in names
        ]
        p, missing = predictions[i], [k for k in _PREDICTED_BESIDE if k not in names]
        extra = "".join(f" {k[4:-10]} {getattr(p, _PREDICTED_BESIDE[k]) / 1e9:.5g}" for k in missing)
        rows.append(
            f"{i:>5} pred " + "  ".join(predicted) + f"  (predicted{extra} total {p.total_bytes / 1e9:.5g})"
        )
    rows.append("  max      " + "  ".join(f"{peak[n]:>28}" for n in names))
    title = " memory per pipeline stage (GB; 'pred' rows: theoretical_memory's prediction, not measured):"
    print_rank_last("\n".join([title, header, *rows]))


@contextlib.contextmanager
def out_of_memory_postmortem(config: ConfigContainer, state: GlobalState):
    """Turn this rank's out-of-memory error into a post-mortem file and OutOfMemoryPostMortem."""
    try:
        yield
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        stage, dp_rank = (
            (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank(True))
            if parallel_state.model_parallel_is_initialized()
            else (0, 0)
        )
        iteration = state.train_state.step + 1  # the one that was running
        p = config.profiling
        if p is not None and p.record_memory_history:
            dump_memory_snapshot(oom_snapshot_path(p.memory_snapshot_path, rank))
        path = write_postmortem(config, rank, stage, dp_rank, iteration, err)
        raise OutOfMemoryPostMortem(rank, stage, iteration, path, short_error(err)) from err


def pretrain(config: ConfigContainer, forward_step_func) -> None:
    """Train ``config`` with ``forward_step_func(data_iterator, model)``. Runs on every rank."""
    state = GlobalState(config)
    success = False
    try:
        if config.profiling is not None and config.profiling.record_memory_history:
            start_memory_history()
        with out_of_memory_postmortem(config, state):
            s = setup(state)
            _print_layout(config)
            if config.logger.tensorboard_dir:
                print_rank_last(f" TensorBoard logs: {config.logger.tensorboard_dir}")
            train(forward_step_func, s)
            if config.logger.log_memory_to_tensorboard:
                _print_memory_table(config, s.pg_collection)
        success = True
    finally:
        state.close_loggers(success)
        if success and dist.is_initialized():
            dist.barrier()  # no rank tears down while another still talks to it
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
