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


def _print_memory_table(config: ConfigContainer, pg_collection) -> None:
    """Each stage's final memory report, as a table on the last rank. Collective over the pp group."""
    peak, stages = gather_memory_across_pp_group(report_memory(config.logger.memory_keys), pg_collection.pp)
    names = list(peak)
    header = "stage  " + "  ".join(f"{n:>28}" for n in names)
    rows = [f"{i:>5}  " + "  ".join(f"{s[n]:>28}" for n in names) for i, s in enumerate(stages)]
    rows.append("  max  " + "  ".join(f"{peak[n]:>28}" for n in names))
    print_rank_last("\n".join([" memory per pipeline stage (GB):", header, *rows]))


@contextlib.contextmanager
def out_of_memory_postmortem(config: ConfigContainer, state: GlobalState):
    """Turn this rank's out-of-memory error into a post-mortem file and OutOfMemoryPostMortem."""
    try:
        yield
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        stage = (
            parallel_state.get_pipeline_model_parallel_rank()
            if parallel_state.model_parallel_is_initialized()
            else 0
        )
        iteration = state.train_state.step + 1  # the one that was running
        p = config.profiling
        if p is not None and p.record_memory_history:
            dump_memory_snapshot(oom_snapshot_path(p.memory_snapshot_path, rank))
        path = write_postmortem(config, rank, stage, iteration, err)
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
