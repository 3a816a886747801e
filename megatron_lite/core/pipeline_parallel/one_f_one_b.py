"""Megatron's 1F1B schedule (pipelining without interleaving), re-exported by ``schedules``.

Stage ``i`` of ``pp`` runs ``min(pp - i - 1, microbatches)`` warmup forwards, then alternates one
forward with one backward, then drains the remaining backwards, so stage ``i`` never holds more than
``pp - i`` microbatches of activations (sent outputs are freed when ``deallocate_pipeline_outputs``).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_lite.core.pipeline_parallel import microbatches as mb
from megatron_lite.core.pipeline_parallel.embedding_wgrad import (
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
)
from megatron_lite.core.pipeline_parallel.p2p_communication import wait_for_sends
from megatron_lite.core.pipeline_parallel.schedule_order import one_f_one_b_warmup
from megatron_lite.core.process_group_utils import get_collective_device
from megatron_lite.core.utils import get_model_config


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
):
    """Run 1F1B over this rank's stage. Collective over the pipeline group (every stage must call
    it with the same microbatch count) and, through ``finalize_model_grads_func``, the gradient groups."""
    model, data_iterator = mb.single_chunk(model, data_iterator, "non-interleaved pipeline-parallel")
    config = get_model_config(model)
    if getattr(config, "overlap_p2p_comm", False):
        raise ValueError("the non-interleaved 1F1B schedule does not overlap p2p communication")
    p2p, pg_collection = mb.communicator_and_groups(config, p2p_communicator, pg_collection)
    tp_group, cp_group = pg_collection.tp, pg_collection.cp
    cp_size = mb.group_size(cp_group)
    first, last = p2p.is_pp_first_stage, p2p.is_pp_last_stage
    embedding_module = clear_embedding_activation_buffer(config, model, last)

    # Gradient sync is held off until the last backward (at once, unless a grad_sync_func syncs
    # stages as they finish: then only the first stage, the last to finish, enables it there).
    no_sync_func = getattr(config, "no_sync_func", None) or contextlib.nullcontext
    grad_sync_func = getattr(config, "grad_sync_func", None)
    no_sync_context = None

    def disable_grad_sync():
        nonlocal no_sync_context
        if no_sync_context is None:
            no_sync_context = no_sync_func()
            no_sync_context.__enter__()

    def enable_grad_sync():
        nonlocal no_sync_context
        if no_sync_context is not None:
            no_sync_context.__exit__(None, None, None)
            no_sync_context = None

    num_warmup = one_f_one_b_warmup(num_microbatches, p2p.total_stages, p2p.current_stage)
    num_steady = num_microbatches - num_warmup
    partial_ckpt = getattr(config, "num_microbatches_with_partial_activation_checkpoints", None)
    max_outstanding = num_warmup + 1 if partial_ckpt is not None else None

    def checkpoint_microbatch(index):
        return None if max_outstanding is None else (index % max_outstanding) >= partial_ckpt

    shape_args = dict(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        config=config,
        tp_group=tp_group,
        cp_group=cp_group,
    )
    recv_shapes, send_shapes = mb.get_tensor_shapes(**shape_args), mb.get_tensor_shapes(**shape_args)
    if adjust_tensor_shapes_fn is not None:
        recv_shapes, send_shapes = adjust_tensor_shapes_fn(recv_shapes, send_shapes)
    deallocate = getattr(config, "deallocate_pipeline_outputs", False)

    forward_data_store: list = []
    input_tensors: list = []
    output_tensors: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=get_collective_device(pg_collection.pp))

    def run_forward(input_tensor, index, is_first_microbatch):
        nonlocal total_num_tokens
        output_tensor, num_tokens = mb.forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            input_tensor,
            forward_data_store,
            config,
            cp_group_size=cp_size,
            collect_non_loss_data=collect_non_loss_data,
            checkpoint_activations_microbatch=checkpoint_microbatch(index),
            is_first_microbatch=mb.check_first_val_step(first_val_step, forward_only, is_first_microbatch),
            current_microbatch=index,
            is_last_stage=last,
        )
        total_num_tokens += num_tokens
        return output_tensor

    with mb.timed(config):
        disable_grad_sync()

        # Warmup: forwards only, filling the pipeline.
        for i in range(num_warmup):
            input_tensor = p2p.recv_forward(recv_shapes, first)
            output_tensor = run_forward(input_tensor, i, i == 0)
            p2p.send_forward(output_tensor, last)
            if not forward_only:
                input_tensors.append(input_tensor)
                output_tensors.append(output_tensor)
                mb.deallocate_output_tensor(output_tensor, deallocate)

        # Steady state: one forward, one backward.
        input_tensor = p2p.recv_forward(recv_shapes, first) if num_steady > 0 else None
        for i in range(num_steady):
            last_iteration = i == num_steady - 1
            output_tensor = run_forward(input_tensor, i + num_warmup, i == 0 and num_warmup == 0)
            if forward_only:
                p2p.send_forward(output_tensor, last)
                if not last_iteration:
                    input_tensor = p2p.recv_forward(recv_shapes, first)
                continue
            output_tensor_grad = p2p.send_forward_recv_backward(output_tensor, send_shapes, last)
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            mb.deallocate_output_tensor(output_tensor, deallocate)
            input_tensor, output_tensor = input_tensors.pop(0), output_tensors.pop(0)
            if num_warmup == 0 and last_iteration and (grad_sync_func is None or first):
                enable_grad_sync()
            input_tensor_grad = mb.backward_step(input_tensor, output_tensor, output_tensor_grad, config)
            if last_iteration:
                input_tensor = None
                p2p.send_backward(input_tensor_grad, first)
            else:
                input_tensor = p2p.send_backward_recv_forward(input_tensor_grad, recv_shapes, first)

        # Cooldown: drain the backwards of the warmup microbatches.
        if not forward_only:
            for i in range(num_warmup):
                if i == num_warmup - 1 and (grad_sync_func is None or first):
                    enable_grad_sync()
                input_tensor, output_tensor = input_tensors.pop(0), output_tensors.pop(0)
                output_tensor_grad = p2p.recv_backward(send_shapes, last)
                input_tensor_grad = mb.backward_step(input_tensor, output_tensor, output_tensor_grad, config)
                p2p.send_backward(input_tensor_grad, first)
            if no_sync_context is not None:  # stages that held their sync for grad_sync_func
                enable_grad_sync()
                if grad_sync_func is not None:
                    grad_sync_func(model.parameters())
        enable_grad_sync()  # forward-only: leave no no_sync context open
        if not forward_only:  # the last stage's deferred output-layer GEMMs, while the others finish
            finish_embedding_wgrad_compute(config, embedding_module, last, tp_group)
        else:  # a forward-only pass with grad enabled keeps inputs it never needs
            clear_embedding_activation_buffer(config, model, last)
        wait_for_sends(p2p)  # nothing in flight past the schedule
        mb.finalize_grads([model], config, forward_only, total_num_tokens, pg_collection, force_all_reduce)
    return forward_data_store
