"""Forward-backward schedules, by upstream's name: no pipelining, 1F1B, and interleaved 1F1B
(virtual pipeline stages), and the per-microbatch helpers upstream keeps in this module.

The entry points take Megatron core's keyword arguments. ``model`` (and ``data_iterator``) may be a
single module or a one-element list of chunks. A schedule runs every microbatch of one global-batch
step through ``forward_step_func`` and back and returns the ``forward_data_store``: the last stage's
per-microbatch loss dicts (or collected outputs), [] elsewhere. It then calls the model config's
``finalize_model_grads_func`` (data-parallel and embedding gradient all-reduce) when one is set.
The interleaved schedule takes a list of chunks and a list of iterators, one per chunk. The schedules
live in ``no_pipelining``, ``one_f_one_b`` and ``interleaved``, their shared steps in ``microbatches``.
"""

from __future__ import annotations

from megatron_lite.core import parallel_state
from megatron_lite.core.pipeline_parallel.embedding_wgrad import (
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
)
from megatron_lite.core.pipeline_parallel.interleaved import forward_backward_pipelining_with_interleaving
from megatron_lite.core.pipeline_parallel.microbatches import (
    backward_step,
    backward_step_multimodule,
    check_first_val_step,
    custom_backward,
    deallocate_output_tensor,
    forward_step,
    get_tensor_shapes,
    set_current_microbatch,
)
from megatron_lite.core.pipeline_parallel.no_pipelining import forward_backward_no_pipelining
from megatron_lite.core.pipeline_parallel.one_f_one_b import forward_backward_pipelining_without_interleaving
from megatron_lite.core.pipeline_parallel.p2p_communication import P2PCommunicator


def get_forward_backward_func(
    pp_size: int | None = None, vp_size: int | None = None, schedule_pg_collection=None
):
    """The schedule for ``pp_size`` stages and ``vp_size`` virtual stages (both from parallel_state
    when neither is given): 1F1B when there is more than one stage, else the plain microbatch loop.
    More than one virtual stage selects the interleaved schedule."""
    if schedule_pg_collection is not None:
        raise NotImplementedError("multi-module (MIMO) pipelines are not supported")
    if pp_size is None and vp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size > 1:
        if vp_size is not None and vp_size > 1:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


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
