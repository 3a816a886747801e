"""The process-wide number of microbatches per global batch, as megatron.core's calculator.

Only a constant global batch size is supported: batch-size ramp-up is a feature we do not have, so
``rampup_batch_size`` must be None.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConstantNumMicroBatchesCalculator:
    """global_batch_size = micro_batch_size * data_parallel_size * num_micro_batches, always."""

    num_micro_batches: int
    """Microbatches each data-parallel rank runs per global batch."""
    current_global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_size: int
    """Samples per microbatch on one rank."""

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size


_CALCULATOR: ConstantNumMicroBatchesCalculator | None = None


def _calculator() -> ConstantNumMicroBatchesCalculator:
    assert _CALCULATOR is not None, "num microbatches calculator is not initialized"
    return _CALCULATOR


def get_num_microbatches() -> int:
    return _calculator().get()


def get_current_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def init_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
) -> None:
    """Set the process-wide calculator; refuses a second initialization (use reconfigure)."""
    assert _CALCULATOR is None, "num microbatches calculator is already initialized"
    reconfigure_num_microbatches_calculator(
        rank,
        rampup_batch_size,
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
    )


def reconfigure_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
) -> None:
    """Replace the process-wide calculator (whether or not one was set)."""
    global _CALCULATOR
    if rampup_batch_size is not None:
        raise ValueError("rampup_batch_size is not supported yet by megatron_lite; it must be None")
    per_step = micro_batch_size * data_parallel_size
    if decrease_batch_size_if_needed:
        global_batch_size -= global_batch_size % per_step
    if global_batch_size <= 0 or global_batch_size % per_step:
        raise ValueError(
            f"global batch size ({global_batch_size}) is not divisible by micro batch size "
            f"({micro_batch_size}) times data parallel size ({data_parallel_size})"
        )
    _CALCULATOR = ConstantNumMicroBatchesCalculator(
        global_batch_size // per_step, global_batch_size, micro_batch_size
    )


def unset_num_microbatches_calculator() -> None:
    global _CALCULATOR
    _CALCULATOR = None


destroy_num_microbatches_calculator = unset_num_microbatches_calculator


def update_num_microbatches(
    consumed_samples: int, consistency_check: bool = True, verbose: bool = False
) -> None:
    """Nothing to update for a constant batch size."""
