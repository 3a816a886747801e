"""Measured activation memory: bytes of the tensors autograd saves for backward.

While :meth:`ActivationMemoryTracker.track` is active, every tensor an autograd node saves passes
through a pack hook that counts its storage (once, however many saved tensors share it) until the
last reference to it is released by autograd, after backward or when the graph is dropped. Parameter
storages are excluded: they are weights, not activations.

The hooks cost a few Python calls per saved tensor (about 3% of a step of the issue-15 model on CPU),
so the training loop tracks only the iterations whose memory gets reported (``track(enabled=...)``);
an iteration run untracked leaves ``tracking`` False and report_memory leaves the activation keys out
rather than show stale numbers.
"""

from __future__ import annotations

import contextlib
import threading

import torch


class _SavedTensor:
    """Holds one saved tensor; releasing it (when autograd drops it) uncounts its storage."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: int, tracker: ActivationMemoryTracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker._release(self.key)


class ActivationMemoryTracker:
    """Current and peak bytes of saved-for-backward storages in this process (peak since start)."""

    def __init__(self) -> None:
        self.current_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage id -> [reference count, bytes]
        self._excluded: set[int] = set()
        self._lock = threading.Lock()
        self.tracking = False  # whether the latest track() counted: its numbers are this iteration's
        self.tracked_once = False  # whether any track() counted: the peak since start is then known

    def reset(self) -> None:
        """Forget every count and exclusion (a stage's dry run keeps nothing of its parent process's)."""
        self.__init__()

    def exclude_parameters(self, parameters) -> None:
        """Never count these tensors' storages (model weights saved by linear layers, say)."""
        for p in parameters:
            self._excluded.add(p.untyped_storage()._cdata)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        # Keyed by the StorageImpl, which a fake tensor (the preflight's dry run) also has.
        key = storage._cdata
        if key in self._excluded or storage.nbytes() == 0:
            return tensor
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                self._refs[key] = [1, storage.nbytes()]
                self.current_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            else:
                entry[0] += 1
        return _SavedTensor(tensor, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _SavedTensor) else packed

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.current_bytes -= entry[1]
                del self._refs[key]

    @contextlib.contextmanager
    def track(self, enabled: bool = True):
        """Count tensors saved by forward passes run inside this context; with ``enabled`` False count
        nothing (no hooks, no cost) and mark the numbers as not this iteration's."""
        self.tracking = enabled
        self.tracked_once = self.tracked_once or enabled
        if not enabled:
            yield self
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


# Process-wide, like torch.cuda's allocator statistics that report_memory also reads.
ACTIVATION_MEMORY = ActivationMemoryTracker()
