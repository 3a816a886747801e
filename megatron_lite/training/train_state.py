"""TrainState: the run's progress, checkpointed as tensors (Megatron-Bridge's, importable from
megatron_lite.training.state as upstream)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# TrainState fields and the tensor dtype each is checkpointed as (int64: no overflow on long runs).
_TRAIN_STATE_DTYPES = {
    "step": torch.int64,
    "consumed_train_samples": torch.int64,
    "skipped_train_samples": torch.int64,
    "consumed_valid_samples": torch.int64,
    "floating_point_operations_so_far": torch.float64,
    "do_train": torch.bool,
    "do_valid": torch.bool,
    "do_test": torch.bool,
}


@dataclass
class TrainState:
    """Training progress; checkpointed as tensors and restored exactly."""

    step: int = 0
    """Iterations completed."""
    consumed_train_samples: int = 0
    """Training samples consumed (skipped iterations included)."""
    skipped_train_samples: int = 0
    """Samples of iterations skipped for a NaN/inf gradient."""
    consumed_valid_samples: int = 0
    """Validation samples consumed."""
    floating_point_operations_so_far: int = 0
    """Model FLOPs spent so far (a float once loaded from a checkpoint)."""
    do_train: bool = False
    """Whether this run trains."""
    do_valid: bool = False
    """Whether this run validates."""
    do_test: bool = False
    """Whether this run tests."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every field as a 0-d tensor (int64, float64 or bool)."""
        return {
            name: torch.tensor(getattr(self, name), dtype=dtype)
            for name, dtype in _TRAIN_STATE_DTYPES.items()
        }

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore every field from ``state_dict()``'s tensors (any integer dtype is accepted)."""
        for name in _TRAIN_STATE_DTYPES:
            setattr(self, name, state_dict[name].item())
