"""Megatron's interleaved 1F1B schedule (virtual pipeline stages), re-exported by ``schedules``.

Each pipeline rank holds ``vp`` model chunks; a microbatch goes through chunk 0 of every rank, then
chunk 1 of every rank, and so on, the last rank passing each chunk's output back to the first rank
(the ring). Work is ordered by "virtual microbatches": upstream's schedule table takes groups of
``microbatch_group_size_per_vp_stage`` (default pp) microbatches through every chunk in turn. Rank
``r`` runs ``(pp - r - 1) * 2 + (vp - 1) * group`` warmup forwards (capped at the total), then
alternates one forward with one backward, then drains the backwards. Every step is one batched
exchange with the neighbours; the receiving rank files what arrives under the chunk that will use it.
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
from megatron_lite.core.pipeline_parallel.schedule_order import (
    check_interleaving,
    get_pp_rank_microbatches,
    get_schedule_table,
)
from megatron_lite.core.process_group_utils import get_collective_device
from megatron_lite.core.utils import get_model_config


def forward_backward_pipelining_with_interleaving(
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
    """Run interleaved 1F1B over this rank's model chunks (``model`` and ``data_iterator`` are lists,
    one per chunk). Collective over the pipeline group and, through ``finalize_model_grads_func``, the
    gradient groups."""
    assert isinstance(model, list) and len(model) > 1, "interleaving needs a list of model chunks"
    assert isinstance(data_iterator, list), "interleaving needs one data iterator per model chunk"
    assert adjust_tensor_shapes_fn is None, "adjust_tensor_shapes_fn is not supported with interleaving"
    config = get_model_config(model[0])
    if getattr(config, "overlap_p2p_comm", False):
        raise NotImplementedError("overlap_p2p_comm is not supported by megatron_lite")
    p2p, pg_collection = mb.communicator_and_groups(config, p2p_communicator, pg_collection)
    pp, rank = p2p.total_stages, p2p.current_stage
    first, last = p2p.is_pp_first_stage, p2p.is_pp_last_stage
    embedding_module = clear_embedding_activation_buffer(config, model, last)
    chunks = len(model)
    group = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp
    check_interleaving(num_microbatches, pp, group)
    (shape,) = mb.get_tensor_shapes(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        config=config,
        tp_group=pg_collection.tp,
        cp_group=pg_collection.cp,
    )
    total, all_warmup, num_warmup, num_remaining = get_pp_rank_microbatches(
        num_microbatches, chunks, group, pp, rank, forward_only
    )
    table = get_schedule_table(num_microbatches, chunks, group)
    cp_size = mb.group_size(pg_collection.cp)
    deallocate = getattr(config, "deallocate_pipeline_outputs", False)

    def chunk_of(k: int, forward: bool) -> int:
        chunk = table[k % total][1]
        return chunk if forward else chunks - chunk - 1

    def receive_for(k: int, forward: bool) -> tuple[bool, int]:
        """Whether this rank receives after virtual microbatch ``k``, and for which chunk."""
        leading = first if forward else last
        last_chunk = chunks - 1 if forward else 0
        if not leading:
            return True, chunk_of(k + 1, forward)
        # The first (forward) or last (backward) rank receives from the other end of the ring,
        # pp - 1 virtual microbatches behind, for the following chunk.
        if k < pp - 1:
            return False, chunk_of(k + 1, forward)
        source = chunk_of(k - (pp - 1), forward)
        return source != last_chunk, source + (1 if forward else -1)

    input_tensors = [[] for _ in model]
    output_tensors = [[] for _ in model]
    output_tensor_grads = [[] for _ in model]
    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=get_collective_device(pg_collection.pp))

    def forward(k: int):
        nonlocal total_num_tokens
        chunk, microbatch = chunk_of(k, True), table[k][0]
        if chunk == 0 and first and len(input_tensors[chunk]) == len(output_tensors[chunk]):
            input_tensors[chunk].append(None)  # the first chunk of the first rank reads data, not a tensor
        input_tensor = input_tensors[chunk][len(output_tensors[chunk])]
        output_tensor, num_tokens = mb.forward_step(
            forward_step_func,
            data_iterator[chunk],
            model[chunk],
            num_microbatches,
            input_tensor,
            forward_data_store,
            config,
            cp_group_size=cp_size,
            collect_non_loss_data=collect_non_loss_data,
            is_first_microbatch=mb.check_first_val_step(first_val_step, forward_only, microbatch == 0),
            current_microbatch=microbatch,
            vp_stage=chunk,
            is_last_stage=last and chunk == chunks - 1,
        )
        total_num_tokens += num_tokens
        output_tensors[chunk].append(output_tensor)
        if forward_only:
            input_tensors[chunk].pop(0)
            output_tensors[chunk].pop()
        # The last chunk of the last rank computed the loss: nothing to send on.
        return None if (last and chunk == chunks - 1) else output_tensor

    def backward(k: int):
        chunk = chunk_of(k, False)
        if last and chunk == chunks - 1 and not output_tensor_grads[chunk]:
            output_tensor_grads[chunk].append(None)
        grad = mb.backward_step(
            input_tensors[chunk].pop(0),
            output_tensors[chunk].pop(0),
            output_tensor_grads[chunk].pop(0),
            config,
        )
        return None if (first and chunk == 0) else grad

    no_sync_func = getattr(config, "no_sync_func", None) or contextlib.nullcontext
    with mb.timed(config), contextlib.ExitStack() as no_sync:
        no_sync.enter_context(no_sync_func())
        input_tensors[0].append(p2p.recv_forward(shape, first))

        for k in range(num_warmup):
            output_tensor = forward(k)
            recv_prev, next_chunk = receive_for(k, True)
            recv_prev = recv_prev and k != total - 1
            if k == num_warmup - 1 and not forward_only and not all_warmup:
                input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                    output_tensor, None, recv_prev=recv_prev, recv_next=not last, tensor_shape=shape
                )
                output_tensor_grads[chunks - 1].append(output_grad)
            else:
                input_tensor = p2p.send_forward_recv_forward(output_tensor, recv_prev, shape)
            if recv_prev:
                input_tensors[next_chunk].append(input_tensor)
            mb.deallocate_output_tensor(output_tensor, deallocate)

        for k in range(num_remaining):
            output_tensor = forward(k + num_warmup)
            input_grad = backward(k)
            recv_prev, next_forward_chunk = receive_for(k + num_warmup, True)
            recv_next, next_backward_chunk = receive_for(k, False)
            recv_prev = recv_prev and k != num_remaining - 1
            input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                output_tensor, input_grad, recv_prev=recv_prev, recv_next=recv_next, tensor_shape=shape
            )
            mb.deallocate_output_tensor(output_tensor, deallocate)
            if recv_prev:
                input_tensors[next_forward_chunk].append(input_tensor)
            if recv_next:
                output_tensor_grads[next_backward_chunk].append(output_grad)

        if not forward_only:
            if all_warmup:
                output_tensor_grads[chunks - 1].append(p2p.recv_backward(shape, last))
            for k in range(num_remaining, total):
                if k == total - 1:
                    no_sync.close()  # the last backward may sync the gradients
                input_grad = backward(k)
                recv_next, next_chunk = receive_for(k, False)
                recv_next = recv_next and k != total - 1
                output_grad = p2p.send_backward_recv_backward(input_grad, recv_next, shape)
                if recv_next:
                    output_tensor_grads[next_chunk].append(output_grad)
        no_sync.close()
        if not forward_only:  # the last stage's deferred output-layer GEMMs, while the others finish
            finish_embedding_wgrad_compute(config, embedding_module, last, pg_collection.tp)
        else:  # a forward-only pass with grad enabled keeps inputs it never needs
            clear_embedding_activation_buffer(config, model, last)
        wait_for_sends(p2p)  # nothing in flight past the schedule
        mb.finalize_grads(model, config, forward_only, total_num_tokens, pg_collection, force_all_reduce)
    return forward_data_store
