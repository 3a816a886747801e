"""What every schedule does per microbatch: the forward and backward steps, freeing a sent output,
the tensor shapes stages exchange, the groups and communicator a schedule uses, and the gradient
finalisation after the last microbatch. The schedules (no_pipelining, one_f_one_b, interleaved) call
these through this module, so a test that patches ``microbatches.forward_step`` reaches every loop.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd import Variable

from megatron_lite.core import parallel_state
from megatron_lite.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron_lite.core.utils import get_attr_wrapped_model


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


def group_size(group) -> int:
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

    if cp_group_size is None:
        initialized = parallel_state.model_parallel_is_initialized()
        cp_group_size = parallel_state.get_context_parallel_world_size() if initialized else 1
    if getattr(config, "num_moe_experts", None):
        # The routers' auxiliary losses reach backward through MoEAuxLossAutoScaler, scaled as the
        # main loss is (on every stage: the MoE layers may be anywhere). Each context-parallel rank's
        # loss is its part of the sequence's, and gradients are averaged over those ranks: x cp.
        scale = torch.ones(1)
        if getattr(config, "grad_scale_func", None) is not None:
            scale = config.grad_scale_func(scale)
        if getattr(config, "calculate_per_token_loss", False):
            # As upstream: unscaled here, divided by the step's tokens with every gradient.
            MoEAuxLossAutoScaler.set_loss_scale(scale)
        else:
            MoEAuxLossAutoScaler.set_loss_scale(scale * cp_group_size / num_microbatches)

    num_tokens = torch.tensor(0, dtype=torch.int)
    if is_last_stage:
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
    seq = (decoder_seq_length if decoder_seq_length is not None else seq_length) // group_size(cp_group)
    if getattr(config, "sequence_parallel", False):
        seq //= group_size(tp_group)
    return [(seq, micro_batch_size, config.hidden_size)]


def single_chunk(model, data_iterator, schedule: str):
    if isinstance(model, list):
        assert len(model) == 1, f"the {schedule} schedule does not support model chunking"
        model = model[0]
    if isinstance(data_iterator, list):
        assert len(data_iterator) == 1, f"the {schedule} schedule does not support model chunking"
        data_iterator = data_iterator[0]
    return model, data_iterator


def finalize_grads(
    chunks: list, config, forward_only, total_num_tokens, pg_collection, force_all_reduce
) -> None:
    """After the last microbatch: the config's ``finalize_model_grads_func`` over ``chunks`` (the
    data-parallel and embedding gradient reductions), unless forward only. Collective over those groups."""
    finalize = getattr(config, "finalize_model_grads_func", None)
    if finalize is not None and not forward_only:
        per_token = getattr(config, "calculate_per_token_loss", False)
        finalize(
            chunks,
            total_num_tokens if per_token else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )


@contextlib.contextmanager
def timed(config):
    """The whole schedule under the config's ``forward-backward`` timer, when the config has timers."""
    timers = getattr(config, "timers", None)
    if timers is None:
        yield
        return
    timer = timers("forward-backward", log_level=1)
    timer.start(barrier=getattr(config, "barrier_with_L1_time", False))
    yield
    timer.stop()


def communicator_and_groups(config, p2p_communicator, pg_collection):
    """The communicator and groups to use: both from parallel_state when neither is given; a
    communicator over ``pg_collection.pp`` when only the collection is given."""
    if p2p_communicator is not None and pg_collection is None:
        raise ValueError("pass pg_collection with p2p_communicator (or neither)")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if not isinstance(pg_collection, ProcessGroupCollection):
        raise TypeError(f"pg_collection must be a ProcessGroupCollection, got {type(pg_collection).__name__}")
    assert hasattr(pg_collection, "tp") and hasattr(pg_collection, "cp"), "pg_collection must have tp and cp"
    if p2p_communicator is None:
        p2p_communicator = P2PCommunicator(pg_collection.pp, config)
    return p2p_communicator, pg_collection
