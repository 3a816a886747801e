"""Forward-backward schedules: no pipelining, 1F1B, and interleaved 1F1B (virtual pipeline stages).

The entry points take Megatron core's keyword arguments. ``model`` (and ``data_iterator``) may be a
single module or a one-element list of chunks. A schedule runs every microbatch of one global-batch
step through ``forward_step_func`` and back and returns the ``forward_data_store``: the last stage's
per-microbatch loss dicts (or collected outputs), [] elsewhere. It then calls the model config's
``finalize_model_grads_func`` (data-parallel and embedding gradient all-reduce) when one is set.
The interleaved schedule takes a list of chunks and a list of iterators, one per chunk.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd import Variable

from megatron_lite.core.pipeline_parallel.embedding_wgrad import (
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
)
from megatron_lite.core.pipeline_parallel.interleaved import forward_backward_pipelining_with_interleaving
from megatron_lite.core.pipeline_parallel.one_f_one_b import forward_backward_pipelining_without_interleaving
from megatron_lite.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.utils import get_attr_wrapped_model, get_collective_device, get_model_config


def get_forward_backward_func(
    pp_size: int | None = None, vp_size: int | None = None, schedule_pg_collection=None
):
    """The schedule for ``pp_size`` stages and ``vp_size`` virtual stages (both from parallel_state
    when neither is given): 1F1B when there is more than one stage, else the plain microbatch loop.
    More than one virtual stage selects the interleaved schedule."""
    if schedule_pg_collection is not None:
        raise NotImplementedError("multi-module (MIMO) pipelines are not supported")
    if pp_size is None and vp_size is None:
        from megatron_lite.core import parallel_state

        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size > 1:
        if vp_size is not None and vp_size > 1:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def deallocate_output_tensor(out, deallocate_pipeline_outputs: bool = False) -> None:
    """Free a sent output's data, keeping only its autograd node (the next stage holds the values).
    Does nothing unless ``deallocate_pipeline_outputs``; accepts a tensor, a list or a dict of them."""
    if out is None or not deallocate_pipeline_outputs:
        return
    if isinstance(out, (list, tuple, dict)):
        for item in out.values() if isinstance(out, dict) else out:
            deallocate_output_tensor(item, deallocate_pipeline_outputs)
        return
    assert isinstance(out, torch.Tensor), f"expected a tensor, got {type(out).__name__}"
    assert out._base is None, "only a non-view output tensor can be freed after sending"
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward from ``output`` without torch's shape check, which a freed output would fail."""
    if grad_output is None:
        assert output.numel() == 1, "an implicit gradient needs a scalar output"
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


def _wrapped_attr(model, name: str):
    """``name`` from the first of model, model.module, ... that has it (None if none does)."""
    try:
        return get_attr_wrapped_model(model, name)
    except RuntimeError:
        return None


def set_current_microbatch(model, microbatch_id: int) -> None:
    """Record the microbatch index on each decoder layer (what CUDA-graph replay reads upstream)."""
    decoder = _wrapped_attr(model, "decoder")
    for layer in getattr(decoder, "layers", []):
        layer.current_microbatch = microbatch_id


def check_first_val_step(first_val_step, forward_only: bool, cond: bool) -> bool:
    """``cond``, narrowed to the first validation step when a forward-only pass says which it is."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def _group_size(group) -> int:
    return 1 if group is None else group.size()


def _loss_from_outputs(outputs, config, num_microbatches: int, cp_group_size: int):
    """Apply upstream's two loss-function contracts: ``(loss, num_tokens, report)`` is divided by the
    token count (unless per-token loss), ``(loss, report)`` is scaled by the CP size; both by the
    number of microbatches, so gradients accumulate to the step's mean."""
    if len(outputs) == 3:
        loss, num_tokens, reported = outputs
        if not getattr(config, "calculate_per_token_loss", False):
            loss /= torch.clamp(num_tokens, min=1)
            loss /= num_microbatches
        return loss, num_tokens, reported
    assert len(outputs) == 2, "a loss function returns (loss, report) or (loss, num_tokens, report)"
    loss, reported = outputs
    loss *= cp_group_size
    loss /= num_microbatches
    return loss, torch.tensor(0, dtype=torch.int), reported


def forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    input_tensor,
    forward_data_store,
    config,
    cp_group_size=None,
    collect_non_loss_data=False,
    checkpoint_activations_microbatch=None,
    is_first_microbatch=False,
    current_microbatch=None,
    vp_stage=None,
    is_last_stage=True,
):
    """One microbatch forward. Returns ``(output, num_tokens)``: on the last stage the output is the
    loss scaled for accumulation and the loss function's report goes to ``forward_data_store``."""
    timers = getattr(config, "timers", None)
    if timers is not None:
        timers("forward-compute", log_level=2).start()
    if is_first_microbatch and hasattr(model, "set_is_first_microbatch"):
        model.set_is_first_microbatch()
    if current_microbatch is not None:
        set_current_microbatch(model, current_microbatch)
    unwrap = not isinstance(input_tensor, list)
    _wrapped_attr(model, "set_input_tensor")([input_tensor] if unwrap else input_tensor)

    autocast = (
        torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=config.autocast_dtype)
        if getattr(config, "enable_autocast", False)
        else contextlib.nullcontext()
    )
    with autocast:
        if checkpoint_activations_microbatch is None:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
        else:
            output_tensor, loss_func = forward_step_func(
                data_iterator, model, checkpoint_activations_microbatch
            )

    num_tokens = torch.tensor(0, dtype=torch.int)
    if is_last_stage:
        if cp_group_size is None:
            from megatron_lite.core import parallel_state

            initialized = parallel_state.model_parallel_is_initialized()
            cp_group_size = parallel_state.get_context_parallel_world_size() if initialized else 1
        if loss_func is None:
            forward_data_store.append(output_tensor)
        elif collect_non_loss_data:
            forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        else:
            output_tensor, num_tokens, reported = _loss_from_outputs(
                loss_func(output_tensor), config, num_microbatches, cp_group_size
            )
            forward_data_store.append(reported)
    if timers is not None:
        timers("forward-compute").stop()
    return (output_tensor if unwrap else [output_tensor]), num_tokens


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """One microbatch backward; returns the gradient of this stage's input (None on the first stage).
    A freed output (``deallocate_pipeline_outputs``) goes through ``custom_backward``."""
    timers = getattr(config, "timers", None)
    if timers is not None:
        timers("backward-compute", log_level=2).start()
    unwrap = not isinstance(input_tensor, list)
    inputs = [input_tensor] if unwrap else input_tensor
    for x in inputs:
        if x is not None:
            x.retain_grad()
    outputs = output_tensor if isinstance(output_tensor, list) else [output_tensor]
    grads = output_tensor_grad if isinstance(output_tensor_grad, list) else [output_tensor_grad]
    grad_scale_func = getattr(config, "grad_scale_func", None)
    if grads[0] is None and grad_scale_func is not None:
        outputs[0] = grad_scale_func(outputs[0])
    if outputs[0].requires_grad:
        if getattr(config, "deallocate_pipeline_outputs", False):
            custom_backward(outputs[0], grads[0])
        else:
            torch.autograd.backward(outputs[0], grad_tensors=grads[0])
    input_grads = [None if x is None else x.grad for x in inputs]
    if timers is not None:
        timers("backward-compute").stop()
    return input_grads[0] if unwrap else input_grads


def backward_step_multimodule(
    input_tensor, output_tensor, output_tensor_grad, config, language_model_module_name
):
    """Backward for multi-module (MIMO) pipelines: not supported, refused here."""
    raise NotImplementedError("multi-module (MIMO) pipelines are not supported")


def get_tensor_shapes(
    *, seq_length, micro_batch_size, decoder_seq_length, config, tp_group=None, cp_group=None
):
    """Shapes of the activations sent between stages: [(seq / cp [/ tp with sequence parallel],
    micro batch, hidden)], or [()] when shapes are exchanged per microbatch."""
    if getattr(config, "variable_seq_lengths", False):
        return [()]
    seq = (decoder_seq_length if decoder_seq_length is not None else seq_length) // _group_size(cp_group)
    if getattr(config, "sequence_parallel", False):
        seq //= _group_size(tp_group)
    return [(seq, micro_batch_size, config.hidden_size)]


def _single_chunk(model, data_iterator, schedule: str):
    if isinstance(model, list):
        assert len(model) == 1, f"the {schedule} schedule does not support model chunking"
        model = model[0]
    if isinstance(data_iterator, list):
        assert len(data_iterator) == 1, f"the {schedule} schedule does not support model chunking"
        data_iterator = data_iterator[0]
    return model, data_iterator


def _finalize(model, config, forward_only, total_num_tokens, pg_collection, force_all_reduce) -> None:
    finalize = getattr(config, "finalize_model_grads_func", None)
    if finalize is not None and not forward_only:
        per_token = getattr(config, "calculate_per_token_loss", False)
        finalize(
            [model],
            total_num_tokens if per_token else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )


@contextlib.contextmanager
def _timed(config):
    """The whole schedule under the config's ``forward-backward`` timer, when the config has timers."""
    timers = getattr(config, "timers", None)
    if timers is None:
        yield
        return
    timer = timers("forward-backward", log_level=1)
    timer.start(barrier=getattr(config, "barrier_with_L1_time", False))
    yield
    timer.stop()


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
    model, data_iterator = _single_chunk(model, data_iterator, "non-pipelined")
    assert adjust_tensor_shapes_fn is None, "adjust_tensor_shapes_fn is for the pipelined schedule only"
    config = get_model_config(model)
    no_sync = getattr(config, "no_sync_func", None) or contextlib.nullcontext
    cp_size = _group_size(pg_collection.cp)
    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=get_collective_device(pg_collection.dp_cp))

    def run(i: int) -> None:
        nonlocal total_num_tokens
        output_tensor, num_tokens = forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            None,
            forward_data_store,
            config,
            cp_size,
            collect_non_loss_data,
            is_first_microbatch=check_first_val_step(first_val_step, forward_only, i == 0),
            current_microbatch=i,
        )
        total_num_tokens += num_tokens
        if not forward_only:
            backward_step(None, output_tensor, None, config)

    with _timed(config):
        with no_sync():
            for i in range(num_microbatches - 1):
                run(i)
        run(num_microbatches - 1)  # outside no_sync: its backward may sync the gradients
        _finalize(model, config, forward_only, total_num_tokens, pg_collection, force_all_reduce)
    return forward_data_store


__all__ = [
    "backward_step",
    "backward_step_multimodule",
    "check_first_val_step",
    "clear_embedding_activation_buffer",
    "custom_backward",
    "deallocate_output_tensor",
    "finish_embedding_wgrad_compute",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_step",
    "get_forward_backward_func",
    "get_tensor_shapes",
    "set_current_microbatch",
    "P2PCommunicator",
]
