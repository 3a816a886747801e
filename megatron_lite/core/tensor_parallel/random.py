"""RNG streams for dropout under tensor parallelism, as megatron.core.tensor_parallel.random.

Dropout on activations that every tensor-parallel rank holds whole (hidden dropout) uses the default
generator, seeded alike on all TP ranks so they drop the same elements. Dropout inside the TP region
(attention probabilities of this rank's heads) runs under ``get_cuda_rng_tracker().fork()``, a stream
seeded differently per TP rank. The tracker swaps the CUDA generator's state when the model is on a
GPU and the CPU generator's otherwise, so the same code runs on both.
"""

from __future__ import annotations

import contextlib

import torch

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _use_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _use_cuda() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named RNG states; ``fork(name)`` runs a block on that stream and advances it."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        original = _get_state()
        if _use_cuda():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states_[name] = _get_state()
        _set_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added; call model_parallel_cuda_manual_seed first")
        original = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(original)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int = 0) -> None:
    """Seed the default stream with ``seed`` (alike on all TP ranks) and the model-parallel stream with
    ``seed + 2718 + tp_rank`` (different per TP rank), as Megatron does."""
    if _use_cuda():
        torch.cuda.manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.reset()
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
