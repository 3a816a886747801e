"""Forward-backward schedules: no pipelining, and 1F1B (pipelining without interleaving).

A schedule runs every microbatch of one global-batch step through ``forward_step_func`` and back, and
returns the last stage's per-microbatch loss dicts ([] elsewhere). It then calls the model config's
``finalize_model_grads_func`` (data-parallel and embedding gradient all-reduce) when one is set.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.autograd import Variable

from megatron_lite.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_lite.core.utils import get_model_config


def get_forward_backward_func(pp_size: int | None = None):
    """1F1B when there is more than one pipeline stage, otherwise the plain microbatch loop."""
    if pp_size is None:
        from megatron_lite.core import parallel_state

        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    return forward_backward_pipelining_without_interleaving if pp_size > 1 else forward_backward_no_pipelining


def deallocate_output_tensor(out: torch.Tensor | None) -> None:
    """Free a sent output's data, keeping only its autograd node; the next stage holds the values."""
    if out is None:
        return
    assert out._base is None, "only a non-view output tensor can be freed after sending"
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward from ``output`` without torch's shape check, which a freed output would fail."""
    if grad_output is None:
        grad_output = torch.ones_like(output)
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    input_tensor,
    forward_data_store,
    is_last_stage: bool,
):
    """One microbatch forward. On the last stage, returns the loss scaled for accumulation."""
    model.set_input_tensor(input_tensor)
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    if not is_last_stage:
        return output_tensor
    outputs = loss_func(output_tensor)
    if len(outputs) == 3:
        loss, num_tokens, reported = outputs
        loss = loss / num_tokens
    else:
        loss, reported = outputs
    forward_data_store.append(reported)
    return loss / num_microbatches


def backward_step(input_tensor, output_tensor, output_tensor_grad):
    """One microbatch backward; returns the gradient of this stage's input (None on the first stage)."""
    if input_tensor is not None:
        input_tensor.retain_grad()
    custom_backward(output_tensor, output_tensor_grad)
    return None if input_tensor is None else input_tensor.grad


def _finalize(model, config, forward_only: bool) -> None:
    finalize = getattr(config, "finalize_model_grads_func", None)
    if finalize is not None and not forward_only:
        finalize([model])


def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length=None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step=None,
    pg_collection=None,
):
    """Each microbatch forward then backward on one stage; gradients sync only after the last one."""
    config = get_model_config(model)
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    forward_data_store: list = []
    for i in range(num_microbatches):
        sync_context = contextlib.nullcontext() if i == num_microbatches - 1 else no_sync()
        with sync_context:
            output = forward_step(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                None,
                forward_data_store,
                is_last_stage=True,
            )
            if not forward_only:
                backward_step(None, output, None)
    _finalize(model, config, forward_only)
    return forward_data_store


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length=None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step=None,
    pg_collection=None,
    p2p_communicator=None,
):
    """Megatron's 1F1B. Stage ``i`` of ``pp`` runs ``min(pp - i - 1, microbatches)`` warmup forwards,
    then alternates one forward with one backward, then drains the remaining backwards. So stage ``i``
    never holds more than ``pp - i`` microbatches of activations."""
    config = get_model_config(model)
    if pg_collection is None:
        from megatron_lite.core.process_groups_config import ProcessGroupCollection

        pg_collection = ProcessGroupCollection.use_mpu_process_groups(["pp"])
    p2p = p2p_communicator or P2PCommunicator(pg_collection.pp, config)
    stage, stages = dist.get_rank(pg_collection.pp), dist.get_world_size(pg_collection.pp)
    # With context parallelism each rank holds seq_length / cp positions (as in Megatron's p2p shapes).
    tensor_shape = (seq_length // config.context_parallel_size, micro_batch_size, config.hidden_size)
    num_warmup = min(stages - stage - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    last = p2p.is_last_stage

    def run_forward(input_tensor):
        return forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            input_tensor,
            forward_data_store,
            is_last_stage=last,
        )

    forward_data_store: list = []
    input_tensors: list = []
    output_tensors: list = []

    # Warmup: forwards only, filling the pipeline.
    for _ in range(num_warmup):
        input_tensor = p2p.recv_forward(tensor_shape)
        output_tensor = run_forward(input_tensor)
        p2p.send_forward(output_tensor)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            if not last:
                deallocate_output_tensor(output_tensor)

    # Steady state: one forward, one backward.
    input_tensor = p2p.recv_forward(tensor_shape) if num_steady > 0 else None
    for i in range(num_steady):
        last_iteration = i == num_steady - 1
        output_tensor = run_forward(input_tensor)
        if forward_only:
            p2p.send_forward(output_tensor)
            if not last_iteration:
                input_tensor = p2p.recv_forward(tensor_shape)
            continue
        output_tensor_grad = p2p.send_forward_recv_backward(output_tensor, tensor_shape)
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)
        if not last:
            deallocate_output_tensor(output_tensor)
        input_tensor_grad = backward_step(input_tensors.pop(0), output_tensors.pop(0), output_tensor_grad)
        if last_iteration:
            input_tensor = None
            p2p.send_backward(input_tensor_grad)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_tensor_grad, tensor_shape)

    # Cooldown: drain the backwards of the warmup microbatches.
    if not forward_only:
        for _ in range(num_warmup):
            output_tensor_grad = p2p.recv_backward(tensor_shape)
            input_tensor_grad = backward_step(input_tensors.pop(0), output_tensors.pop(0), output_tensor_grad)
            p2p.send_backward(input_tensor_grad)

    _finalize(model, config, forward_only)
    return forward_data_store
