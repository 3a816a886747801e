"""What this rank's memory is made of, measured from the tensors: weights, gradient buffers, and the
rest of the allocated total once the optimizer state and activations are taken out; with LoRA the
adapters' part of the weights (the trainable parameters: the gradient buffers and the optimizer state
are theirs alone, the frozen base has neither).

The weights are the model chunks' parameter storages, each counted once (tied weights, and parameters
that are views of one contiguous buffer, share a storage); the gradients are the DDP buffers' fp32
``main_grad`` storage. ``other`` is the allocated total (the caching allocator's on CUDA, the
allocated-bytes tracker's on the CPU) minus weights, gradients, optimizer state and activations:
temporaries, communication buffers, the loss. Without an allocated total (an untracked step on the
CPU) it falls back to the resident set, which also holds the interpreter and torch's libraries.
"""

from __future__ import annotations

import torch


def _unique_storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage._cdata, storage.nbytes())  # the StorageImpl: fake ones too
    return sum(seen.values())


def weights_bytes(model_chunks) -> int:
    """Bytes of the parameters of ``model_chunks``, every storage once."""
    return _unique_storage_bytes(p for chunk in model_chunks for p in chunk.parameters())


def adapter_weights_bytes(model_chunks) -> int | None:
    """Bytes of the trainable parameters when some are frozen (LoRA: the adapters), every storage
    once; None when every parameter trains."""
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    if all(p.requires_grad for p in params):
        return None
    return _unique_storage_bytes(p for p in params if p.requires_grad)


def _grad_tensors(model_chunks) -> list[torch.Tensor]:
    """The gradient buffers (DDP's contiguous ``grad_data``), plus any plain ``.grad``."""
    buffers = [buf.grad_data for chunk in model_chunks for buf in getattr(chunk, "buffers", [])]
    return buffers + [p.grad for chunk in model_chunks for p in chunk.parameters() if p.grad is not None]


def grads_bytes(model_chunks) -> int:
    """Bytes of the gradient buffers and plain gradients, every storage once."""
    return _unique_storage_bytes(_grad_tensors(model_chunks))


class ModelMemory:
    """Holds the run's model chunks so the memory report can measure their weights and gradients."""

    def __init__(self):
        self.model_chunks: list[torch.nn.Module] | None = None

    def track(self, model_chunks) -> None:
        self.model_chunks = list(model_chunks)

    def stats(self) -> dict[str, int]:
        if self.model_chunks is None:
            return {}
        stats = {
            "weights_bytes.current": weights_bytes(self.model_chunks),
            "grads_bytes.current": grads_bytes(self.model_chunks),
        }
        adapters = adapter_weights_bytes(self.model_chunks)
        if adapters is not None:  # LoRA: the adapters' part of the weights
            stats["adapter_weights_bytes.current"] = adapters
        return stats


MODEL_MEMORY = ModelMemory()


def static_tensors(model_chunks, optimizer) -> list[torch.Tensor]:
    """Every tensor that lives for the whole run: parameters, gradient buffers (and plain grads), the
    optimizer's own parameters (fp32 masters, distributed-optimizer shards) and its state."""
    tensors = [p for chunk in model_chunks for p in chunk.parameters()] + _grad_tensors(model_chunks)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
    return tensors


def other_memory_stats(stats: dict[str, int]) -> dict[str, int]:
    """``other_bytes.*`` from a statistics dict that already holds the totals and the parts.

    Current: the total now minus weights, gradients, optimizer state and the activations alive now.
    Peak: the rest at the instant of the allocated peak: on the CPU the tracker's own make-up of that
    instant (its static and saved bytes then); on CUDA the peak total minus the static parts and the
    activations' peak (the activation peak is where the total peaks in training), at least 0. Empty until the model and the optimizer are tracked, and when
    the activations were not (the rest would silently include them).
    """
    parts = ("weights_bytes.current", "grads_bytes.current", "optimizer_state_bytes.current")
    if not all(k in stats for k in (*parts, "activation_bytes.current")):
        return {}
    total, peak = (
        ("allocated_bytes.all.current", "allocated_bytes.all.peak")
        if "allocated_bytes.all.current" in stats
        else ("rss_bytes.current", "rss_bytes.peak")
    )
    if total not in stats:
        return {}
    static = sum(stats[k] for k in parts)
    other = {"other_bytes.current": stats[total] - static - stats["activation_bytes.current"]}
    if "temporaries_bytes.peak" in stats:
        # CPU: the allocated-bytes tracker took the peak's make-up at its instant. The static parts
        # now are not those of the peak's instant: in the first step the optimizer state is made
        # after the activation peak, so "peak - static now - activation peak" went negative there.
        other["other_bytes.peak"] = stats["temporaries_bytes.peak"]
        return other
    # CUDA: the allocator's peak says nothing of its instant; the rest there is at least this (and
    # never negative: a first step's optimizer state did not exist yet at the activation peak).
    other["other_bytes.peak"] = max(0, stats[peak] - static - stats["activation_bytes.peak"])
    if "allocated_bytes.all.peak" in stats:
        other["temporaries_bytes.peak"] = other["other_bytes.peak"]
    return other
