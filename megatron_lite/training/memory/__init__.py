"""Everything memory, one file per part:

- measure: keys.py (the logged names), report.py (``report_memory``, the console line) and
  allocated.py (``ALLOCATED_MEMORY``: live tensor bytes and their peak on the CPU, temporaries included);
- saved tensors: saved_tensors.py (``ACTIVATION_MEMORY``, the saved-for-backward tracker);
- attribution: attribution.py (weights, gradient buffers and "other" from the tensors);
- host allocator: host_allocator.py (glibc keeps freed host memory for reuse);
- pipeline collectives: pipeline.py (the report's max over the stages, ``memory_metrics``);
- predict: predict/ (each stage's predicted weights, gradients, optimizer state, activations,
  temporaries and allocated peak);
- the preflight's verdict table and lever search: table.py and levers.py (the preflight itself and its
  dry run run the loop, so they are run modes: megatron_lite/run_modes/);
- post-mortem: postmortem.py (an out-of-memory rank writes what it held) and table.py (the end-of-run
  table of each stage, measured beside predicted);
- snapshots: snapshots.py (the CUDA allocator's history, as upstream's --record-memory-history).
"""

from megatron_lite.training.memory.allocated import ALLOCATED_MEMORY, AllocatedMemoryTracker
from megatron_lite.training.memory.attribution import MODEL_MEMORY
from megatron_lite.training.memory.host_allocator import keep_freed_host_memory
from megatron_lite.training.memory.keys import (
    ACTIVATION_MEMORY_KEYS,
    ATTRIBUTION_MEMORY_KEYS,
    CUDA_EXTRA_MEMORY_KEYS,
    HOST_MEMORY_KEYS,
    MEMORY_KEYS,
    OPTIMIZER_MEMORY_KEYS,
)
from megatron_lite.training.memory.pipeline import (
    gather_memory_across_pp_group,
    memory_metrics,
    reduce_max_memory_across_pp_group,
)
from megatron_lite.training.memory.postmortem import OutOfMemoryPostMortem, out_of_memory_postmortem
from megatron_lite.training.memory.predict import (
    StageMemoryPrediction,
    predict_memory_per_stage,
    predicted_memory_metrics,
    report_theoretical_memory,
)
from megatron_lite.training.memory.report import (
    OPTIMIZER_STATE_MEMORY,
    default_memory_keys,
    device_memory_capacity_gigabytes,
    format_memory_line,
    report_memory,
)
from megatron_lite.training.memory.saved_tensors import ACTIVATION_MEMORY, ActivationMemoryTracker
from megatron_lite.training.memory.snapshots import dump_memory_snapshot, start_memory_history
from megatron_lite.training.memory.table import print_memory_table

__all__ = [
    "ACTIVATION_MEMORY",
    "ALLOCATED_MEMORY",
    "AllocatedMemoryTracker",
    "ACTIVATION_MEMORY_KEYS",
    "ATTRIBUTION_MEMORY_KEYS",
    "CUDA_EXTRA_MEMORY_KEYS",
    "HOST_MEMORY_KEYS",
    "MEMORY_KEYS",
    "MODEL_MEMORY",
    "OPTIMIZER_MEMORY_KEYS",
    "OPTIMIZER_STATE_MEMORY",
    "ActivationMemoryTracker",
    "OutOfMemoryPostMortem",
    "StageMemoryPrediction",
    "default_memory_keys",
    "device_memory_capacity_gigabytes",
    "dump_memory_snapshot",
    "format_memory_line",
    "gather_memory_across_pp_group",
    "keep_freed_host_memory",
    "memory_metrics",
    "out_of_memory_postmortem",
    "predict_memory_per_stage",
    "predicted_memory_metrics",
    "print_memory_table",
    "reduce_max_memory_across_pp_group",
    "report_memory",
    "report_theoretical_memory",
    "start_memory_history",
]
