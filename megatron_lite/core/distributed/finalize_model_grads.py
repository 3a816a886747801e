"""Gradient finalisation after the last microbatch of a step."""

from __future__ import annotations

import torch.distributed as dist

from megatron_lite.core.utils import unwrap_model


def finalize_model_grads(model_chunks, pg_collection) -> None:
    """Average gradients over data-parallel ranks, then sum the tied word-embedding gradient over the
    embedding group (first and last stage). Collective over the dp group and, on the first and last
    stage, the embedding group."""
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    embd = pg_collection.embd
    if embd is None or dist.get_world_size(embd) == 1:
        return
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        if not model.share_embeddings_and_output_weights:
            continue
        weight = model.shared_embedding_or_output_weight()
        if weight is not None:
            dist.all_reduce(weight.main_grad, group=embd)
