"""The profiling section, Megatron-Bridge's ProfilingConfig (torch.profiler, Nsight Systems, the
CUDA allocator's memory history)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lite.training.errors import require


@dataclass(kw_only=True)
class ProfilingConfig:
    """Profiler settings: torch.profiler traces per rank, or Nsight Systems ranges on CUDA."""

    use_nsys_profiler: bool = False
    """Nsight Systems: start CUDA's profiler at profile_step_start (``--profile``; needs CUDA)."""
    profile_step_start: int = 10
    """Global step to start profiling."""
    profile_step_end: int = 12
    """Global step to stop profiling."""
    use_pytorch_profiler: bool = False
    """torch.profiler: one Chrome trace per profiled rank under <tensorboard_dir>/../torch_profile
    (./torch_profile without a TensorBoard directory)."""
    pytorch_profiler_collect_shapes: bool = False
    """Record tensor shapes in the torch profiler's trace."""
    pytorch_profiler_collect_callstack: bool = False
    """Record Python call stacks in the torch profiler's trace."""
    pytorch_profiler_collect_chakra: bool = False
    """Chakra execution traces (not supported yet)."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks to profile; empty means every rank."""
    record_shapes: bool = False
    """Record tensor shapes in the NVTX ranges of the Nsight Systems profiler."""
    record_memory_history: bool = False
    """Record the CUDA allocator's history on every rank; the last rank writes a snapshot at every log
    interval, a rank that runs out of memory its own (CUDA only)."""
    memory_snapshot_path: str = "snapshot.pickle"
    """Where the last rank writes the memory history snapshot (pickle; open it at pytorch.org/memory_viz)."""

    def finalize(self) -> None:
        require(
            not (self.use_pytorch_profiler and self.use_nsys_profiler),
            "profiling",
            "Exactly one of pytorch or nsys profiler should be enabled, not both",
        )
        require(
            self.profile_step_start >= 0,
            "--profile-step-start",
            f"profile_step_start must be >= 0, got {self.profile_step_start}",
        )
        require(
            self.profile_step_end >= 0,
            "--profile-step-end",
            f"profile_step_end must be >= 0, got {self.profile_step_end}",
        )
        require(
            self.profile_step_end >= self.profile_step_start,
            "profiling",
            f"profile_step_end ({self.profile_step_end}) must be >= profile_step_start ({self.profile_step_start})",
        )
        # torch.profiler records steps start .. end - 1: start == end would record none (and it refuses).
        require(
            not self.use_pytorch_profiler or self.profile_step_end > self.profile_step_start,
            "--profile-step-end",
            f"must exceed --profile-step-start ({self.profile_step_start}) with --use-pytorch-profiler",
        )
