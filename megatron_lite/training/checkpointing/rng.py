"""The random number generators' state a checkpoint carries, so a resumed run draws what an
unbroken one would (dropout, data order)."""

from __future__ import annotations

import random

import numpy as np
import torch

from megatron_lite.core.tensor_parallel.random import get_cuda_rng_tracker


def rng_state() -> dict:
    state = {
        "random": random.getstate(),
        "torch": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    # A tensor, not an ndarray: what weights_only loads (safety.py).
    state["numpy"] = (name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached_gaussian)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    torch.set_rng_state(state["torch"])
    if "rng_tracker_states" in state:
        get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    if "numpy" in state:
        name, key, *rest = state["numpy"]  # key: a tensor, or an older checkpoint's ndarray
        np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
