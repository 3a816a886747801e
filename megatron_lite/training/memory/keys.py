"""The memory statistics' logged names: statistic key -> name, each table one source.

Names follow upstream's ``train_utils``: ``MEMORY_KEYS`` maps ``torch.cuda.memory_stats()`` keys to
logged names (upstream's, order included); the others are ours, in their own tables beside it, so
upstream's dashboards keep working and ours gain the extra panels. A byte count's name becomes
"gigabytes" when reported (:func:`megatron_lite.training.memory.report.report_memory`).
"""

from __future__ import annotations

# torch.cuda.memory_stats() key -> logged name, exactly upstream's (order included).
MEMORY_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "active_bytes.all.current": "mem-active-bytes",
    "inactive_split_bytes.all.current": "mem-inactive-bytes",
    "reserved_bytes.all.current": "mem-reserved-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
    "active_bytes.all.peak": "mem-max-active-bytes",
    "inactive_split_bytes.all.peak": "mem-max-inactive-bytes",
    "reserved_bytes.all.peak": "mem-max-reserved-bytes",
    # Upstream's spelling ("retires"), kept so existing dashboards and alerts keep matching.
    "num_alloc_retries": "mem-alloc-retires",
    "allocation.all.current": "mem-allocated-count",
}

# Our CUDA extras (upstream logs none of them): out-of-memory errors the caching allocator has raised;
# its health: the share of reserved memory not allocated ((reserved - allocated) / reserved), and how
# many allocations it retried (freeing its cache to satisfy them) since the previous report.
CUDA_EXTRA_MEMORY_KEYS: dict[str, str] = {
    "num_ooms": "mem-ooms",
    "fragmentation.current": "mem-fragmentation",
    "num_alloc_retries.delta": "mem-alloc-retries-delta",
}

# Host (no CUDA) statistics, same conventions: upstream's allocated-bytes names with the CUDA meaning
# (live tensor storage and its peak, temporaries included: allocated.py), then the process's resident
# memory from the OS (the interpreter and libraries too: not the headline).
HOST_MEMORY_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
    "rss_bytes.current": "mem-rss-bytes",
    "rss_bytes.peak": "mem-max-rss-bytes",
}

# Saved-for-backward tensors, measured on CPU and CUDA alike by the ActivationMemoryTracker.
ACTIVATION_MEMORY_KEYS: dict[str, str] = {
    "activation_bytes.current": "mem-activation-bytes",
    "activation_bytes.peak": "mem-max-activation-bytes",
}

# This rank's optimizer state (moments and fp32 master copies), measured from the optimizer's tensors;
# present once setup registers the optimizer, so the saving of --use-distributed-optimizer shows.
OPTIMIZER_MEMORY_KEYS: dict[str, str] = {"optimizer_state_bytes.current": "mem-optimizer-state-bytes"}

# What this rank's memory is made of (attribution.py): weights, gradient buffers and the rest.
ATTRIBUTION_MEMORY_KEYS: dict[str, str] = {
    "weights_bytes.current": "mem-weights-bytes",
    "grads_bytes.current": "mem-grads-bytes",
    "adapter_weights_bytes.current": "mem-adapter-weights-bytes",  # LoRA runs only
    "other_bytes.current": "mem-other-bytes",
    "other_bytes.peak": "mem-max-other-bytes",
    "temporaries_bytes.peak": "mem-temporaries-bytes",
}
