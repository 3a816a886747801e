"""pretrain(): set up, train, and always close the loggers."""

from __future__ import annotations

import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.training import checkpointing
from megatron_lite.training.config import ConfigContainer, runtime_config_update
from megatron_lite.training.memory.postmortem import out_of_memory_postmortem
from megatron_lite.training.memory.snapshots import start_memory_history
from megatron_lite.training.memory.table import print_memory_table
from megatron_lite.training.setup import setup
from megatron_lite.training.state import GlobalState
from megatron_lite.training.training import train
from megatron_lite.training.utils.train_utils import print_rank_last


def _print_layout(config: ConfigContainer) -> None:
    if dist.get_rank() != 0:
        return
    m = config.model
    experts = ""
    if m.num_moe_experts:  # the experts' own grid over the same ranks
        experts = (
            f" | {m.num_moe_experts} experts: etp {parallel_state.get_expert_tensor_parallel_world_size()} x "
            f"ep {parallel_state.get_expert_model_parallel_world_size()} x "
            f"expert dp {parallel_state.get_expert_data_parallel_world_size()}"
        )
    print(
        f" megatron_lite: world {dist.get_world_size()} = tp {m.tensor_model_parallel_size} x "
        f"pp {m.pipeline_model_parallel_size} x cp {m.context_parallel_size} x "
        f"dp {parallel_state.get_data_parallel_world_size()}{experts} | backend {dist.get_backend()} | "
        f"{config.num_microbatches} microbatches of {config.train.micro_batch_size} per step",
        flush=True,
    )


def pretrain(config: ConfigContainer, forward_step_func) -> None:
    """Train ``config`` with ``forward_step_func(data_iterator, model)``. Runs on every rank.

    As upstream, a config not yet validated (the Python API's) first goes through
    runtime_config_update: its mixed-precision recipe is applied and every check runs, on every rank
    before any collective. pretrain.py's own parse_args has done that already."""
    if not config._validated:
        runtime_config_update(config)
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
                print_memory_table(config, s.pg_collection)
        success = True
    finally:
        checkpointing.close_async_writer()
        state.close_loggers(success)
        if success and dist.is_initialized():
            dist.barrier()  # no rank tears down while another still talks to it
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
