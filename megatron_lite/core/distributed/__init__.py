"""Data parallelism: gradient buffers, bucketed all-reduce, gradient finalisation."""

from megatron_lite.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_lite.core.distributed.finalize_model_grads import finalize_model_grads

__all__ = ["DistributedDataParallel", "finalize_model_grads"]
