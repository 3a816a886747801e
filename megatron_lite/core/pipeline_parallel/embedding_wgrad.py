"""The schedules' side of ``--defer-embedding-wgrad-compute``, as upstream's schedules: the last
stage's output layer keeps every microbatch's input and output gradient (see
tensor_parallel/linear_wgrad), and once the stage's last backward is done its weight-gradient GEMMs
run, before ``finalize_model_grads`` reduces the gradients. On the last stage that is the cooldown,
when it would otherwise wait for the earlier stages to finish their backwards."""

from __future__ import annotations

from megatron_lite.core.tensor_parallel.linear_wgrad import drain_embedding_wgrad_compute
from megatron_lite.core.utils import get_attr_wrapped_model


def clear_embedding_activation_buffer(config, model, is_last_stage: bool):
    """On the last stage with deferral on: empty the output layer's buffers (nothing stray from an
    earlier, interrupted step) and return the module that holds them; else None."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return None
    if getattr(config, "grad_sync_func", None) is not None:
        raise ValueError(
            "defer_embedding_wgrad_compute cannot be combined with a grad_sync_func (overlapped gradient "
            "reduction): the gradients would be synced before the deferred weight gradients are added"
        )
    module = get_attr_wrapped_model(
        model[-1] if isinstance(model, list) else model, "post_process", return_model_obj=True
    )
    module.embedding_activation_buffer.clear()
    module.grad_output_buffer.clear()
    return module


def finish_embedding_wgrad_compute(config, embedding_module, is_last_stage: bool, tp_group) -> None:
    """On the last stage with deferral on: drain the deferred GEMMs into the output weight's
    ``main_grad``. Collective over ``tp_group`` under sequence parallelism."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return
    weight = embedding_module.output_layer.weight
    if weight is None:  # tied to the embedding on this very rank
        weight = embedding_module.shared_embedding_or_output_weight()
    drain_embedding_wgrad_compute(
        config,
        embedding_module.embedding_activation_buffer,
        embedding_module.grad_output_buffer,
        weight,
        tp_group,
    )
