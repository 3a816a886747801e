"""No pipelining: every microbatch forward then backward on one stage (pp = 1)."""

from __future__ import annotations

import contextlib

import torch

from megatron_lite.core.pipeline_parallel import microbatches as mb
from megatron_lite.core.process_group_utils import get_collective_device
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.utils import get_model_config


def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int | None = None,  # unused: nothing is sent between stages
    micro_batch_size: int | None = None,  # unused
    decoder_seq_length: int | None = None,  # unused
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,  # unused
    pg_collection=None,
    force_all_reduce: bool | None = False,
):
    """Each microbatch forward then backward on one stage; gradients may sync only with the last one.
    Collective only through ``finalize_model_grads_func`` (data-parallel group)."""
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model, data_iterator = mb.single_chunk(model, data_iterator, "non-pipelined")
    assert adjust_tensor_shapes_fn is None, "adjust_tensor_shapes_fn is for the pipelined schedule only"
    config = get_model_config(model)
    no_sync = getattr(config, "no_sync_func", None) or contextlib.nullcontext
    cp_size = mb.group_size(pg_collection.cp)
    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=get_collective_device(pg_collection.dp_cp))

    def run(i: int) -> None:
        nonlocal total_num_tokens
        output_tensor, num_tokens = mb.forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            None,
            forward_data_store,
            config,
            cp_size,
            collect_non_loss_data,
            is_first_microbatch=mb.check_first_val_step(first_val_step, forward_only, i == 0),
            current_microbatch=i,
        )
        total_num_tokens += num_tokens
        if not forward_only:
            mb.backward_step(None, output_tensor, None, config)

    with mb.timed(config):
        with no_sync():
            for i in range(num_microbatches - 1):
                run(i)
        run(num_microbatches - 1)  # outside no_sync: its backward may sync the gradients
        mb.finalize_grads([model], config, forward_only, total_num_tokens, pg_collection, force_all_reduce)
    return forward_data_store
