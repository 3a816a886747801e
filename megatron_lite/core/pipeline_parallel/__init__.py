"""Pipeline parallelism: point-to-point communication and schedules."""

from megatron_lite.core.pipeline_parallel.schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
