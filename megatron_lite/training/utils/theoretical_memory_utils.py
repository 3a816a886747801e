"""Upstream's path for the weight-and-optimizer estimate; it lives in training/memory/predict/estimate.py."""

from __future__ import annotations

from megatron_lite.training.memory.predict.estimate import num_parameters_per_rank, report_theoretical_memory

__all__ = ["num_parameters_per_rank", "report_theoretical_memory"]
