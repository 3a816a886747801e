"""Gradient finalisation after the last microbatch of a step (Megatron core's finalize_model_grads)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.utils import unwrap_model


def _embedding_group(pg_collection):
    if pg_collection is not None:
        assert hasattr(pg_collection, "embd"), "pg_collection must have embd (set it to None if unused)"
        return pg_collection.embd
    from megatron_lite.core import parallel_state

    return parallel_state.get_embedding_group(check_initialized=False)


def _tensor_parallel_group(pg_collection):
    if pg_collection is not None:
        return pg_collection.tp
    from megatron_lite.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def _allreduce_non_tensor_model_parallel_grads(model, tp_group) -> None:
    """Sum the gradients of sequence-parallel parameters (norm weights, row-parallel biases) over the
    tensor-parallel group: each TP rank saw only its share of the sequence. One all-reduce of all of
    them, flattened. Collective over ``tp_group``."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = [
        p.main_grad
        for chunk in model
        for p in unwrap_model(chunk).parameters()
        if p.requires_grad and getattr(p, "sequence_parallel", False)
    ]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def finalize_model_grads(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
) -> None:
    """Average gradients over data-parallel ranks, sum sequence-parallel parameters' gradients over the
    tensor-parallel group, then sum the tied word-embedding gradient over the embedding group (first
    and last stage). Collective over the dp and tp groups and, on the first and last stage, the
    embedding group. Groups come from ``pg_collection``, else from parallel_state.

    ``num_tokens`` (``calculate_per_token_loss``): the step's loss-token count, known on the last
    pipeline stage; it is broadcast over the pipeline group, summed over the data x context group,
    and every gradient is divided by it (the loss was a sum over tokens, the gradients summed over
    ranks), so each loss token weighs the same wherever it was. Collective over those groups too."""
    # Reduce-scatter with the distributed optimizer (its tied-embedding bucket is sharded alike on
    # the first and last stage, so the embedding all-reduce below sums matching shards).
    for chunk in model:
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    _allreduce_non_tensor_model_parallel_grads(model, _tensor_parallel_group(pg_collection))
    _allreduce_embedding_grads(model, _embedding_group(pg_collection))
    if num_tokens is not None:
        _scale_by_num_tokens(model, num_tokens, pg_collection)


def _allreduce_embedding_grads(model, embd) -> None:
    """Sum the tied word-embedding gradient over the first and last stage. Collective over ``embd``."""
    if embd is None or dist.get_world_size(embd) == 1:
        return
    for chunk in model:
        module = unwrap_model(chunk)
        if not getattr(module, "share_embeddings_and_output_weights", False):
            continue
        weight = module.shared_embedding_or_output_weight()
        # A frozen tied embedding (LoRA) has no gradient; it is frozen on both stages alike.
        if weight is not None and weight.requires_grad:
            dist.all_reduce(weight.main_grad, group=embd)


def _scale_by_num_tokens(model, num_tokens: torch.Tensor, pg_collection) -> None:
    """Divide every gradient by the step's loss tokens: ``num_tokens`` from the last pipeline stage,
    summed over data x context ranks (in place). Collective over the pipeline and dp x cp groups."""
    if pg_collection is not None:
        pp_group, dp_cp_group = pg_collection.pp, pg_collection.dp_cp
    else:
        from megatron_lite.core import parallel_state

        pp_group = parallel_state.get_pipeline_model_parallel_group(check_initialized=False)
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        # Only the last stage computed the loss: its count goes to every stage.
        last_rank = dist.get_process_group_ranks(pp_group)[-1]
        dist.broadcast(num_tokens, src=last_rank, group=pp_group)
    if dp_cp_group is not None and dist.get_world_size(dp_cp_group) > 1:
        dist.all_reduce(num_tokens, group=dp_cp_group)
    # Clamped: a step whose tokens are all masked leaves its (zero) gradients as they are.
    scaling = 1.0 / torch.clamp(num_tokens, min=1).double()
    for chunk in model:
        chunk.scale_gradients(scaling)
