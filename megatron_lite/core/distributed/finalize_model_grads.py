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

    ``num_tokens`` (per-token loss scaling, ``calculate_per_token_loss``) is not supported."""
    if num_tokens is not None:
        raise NotImplementedError(
            "calculate_per_token_loss (gradients scaled by num_tokens) is not supported"
        )
    # Reduce-scatter with the distributed optimizer (its tied-embedding bucket is sharded alike on
    # the first and last stage, so the embedding all-reduce below sums matching shards).
    for chunk in model:
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    _allreduce_non_tensor_model_parallel_grads(model, _tensor_parallel_group(pg_collection))
    embd = _embedding_group(pg_collection)
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
