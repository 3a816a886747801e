"""Allocated bytes on the host: live tensor storage and its peak, temporaries included.

On CUDA the caching allocator counts every byte it hands out (``allocated_bytes.all.*``); PyTorch's CPU
allocator keeps no such count. :class:`AllocatedMemoryTracker` gives the CPU the same figure with
PyTorch's own machinery: a ``TorchDispatchMode`` sees every ATen op's outputs, forward and backward
(autograd's engine runs CPU nodes on the calling thread, under the caller's modes), and a weak reference
on each new ``UntypedStorage`` uncounts it when the storage is freed. The current total is the bytes of
all live storages; the peak is taken at every new storage, the only instants a total can rise.

What it misses: scratch a single kernel allocates and frees inside itself (the CPU flash attention's
per-thread blocks, oneDNN's workspaces, gloo's internal buffers), storages that are not the CPU
allocator's (a tensor over ``/dev/shm`` or a numpy array, whose storage is not resizable), sparse and
opaque tensors, and a Python-level ``storage.resize_`` (no op is dispatched: the old size stays counted
until the storage is freed). Higher-order operators (``torch.cond``, flex attention) are refused under
the mode, as under any TorchDispatchMode that does not opt in; nothing here uses them. A test checks
the total against the allocator's own memory events from ``torch.profiler`` (``profile_memory=True``).
The preflight's dry run (run_modes/dry_run/) counts fake tensors with the same tracker: their storages are
``meta`` ones (``reset(storage_device="meta")``), with sizes and weak references like the CPU's.

Tracking costs one Python call per op, so the loop tracks only the iterations whose memory is
reported (and the first two, where the optimizer state materialises); an untracked iteration runs
with no mode and no hook. The first tracked iteration walks the garbage collector's objects once for
the storages that already exist (weights, gradient buffers, the data); each later one only registers
the model's and the optimizer's tensors, which is where anything long-lived is made.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.training.memory.saved_tensors import ACTIVATION_MEMORY


class _CountingMode(TorchDispatchMode):
    """Counts the storages of every op's outputs."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled: skip the torch._dynamo wrapper (and its seconds-long import).
        return False

    def __init__(self, tracker: AllocatedMemoryTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        see = self.tracker._see
        if isinstance(out, torch.Tensor):
            see(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    see(o)
                elif isinstance(o, (tuple, list)):  # e.g. a foreach op's list inside a tuple
                    for p in o:
                        if isinstance(p, torch.Tensor):
                            see(p)
        return out


class AllocatedMemoryTracker:
    """Current and peak bytes of live CPU tensor storage in this process (peak since start), and at the
    peak: how much of it was static (weights, gradient buffers, optimizer state) and saved activations."""

    def __init__(self, saved_activations=None) -> None:
        self.current_bytes = 0
        self.peak_bytes = 0
        self.static_bytes = 0
        self.peak_static_bytes = 0
        self.peak_saved_bytes = 0
        self.tracking = False  # whether the latest track() counted: its numbers are this iteration's
        self.tracked_once = False  # whether any iteration was: the peak since start is then known
        self.saved_activations = saved_activations  # an ActivationMemoryTracker, read at each new peak
        self.static_source = None  # a callable returning the tensors that count as static
        self._live: dict[int, list] = {}  # storage id -> [bytes, weak reference, static]
        self._lock = threading.RLock()  # a weak-reference callback may run in another thread
        self.storage_device = "cpu"  # whose storages count: "meta" for fake tensors' (the dry run)

    def reset(self, storage_device: str = "cpu") -> None:
        """Forget everything and count ``storage_device``'s storages from now on: a stage's dry run
        counts fake tensors (``meta`` storages), nothing of what its parent process counted."""
        with self._lock:
            self.__init__(self.saved_activations)
            self.storage_device = storage_device

    # Registration -------------------------------------------------------------------------------
    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current_bytes -= entry[0]
                if entry[2]:
                    self.static_bytes -= entry[0]

    def _add(self, storage: torch.UntypedStorage, static: bool = False) -> None:
        if storage.device.type != self.storage_device or not storage.resizable():
            return  # not the CPU allocator's bytes (shared memory, numpy)
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                ref = weakref.ref(storage, lambda _, k=key: self._forget(k))
                self._live[key] = [nbytes, ref, static]
                self.current_bytes += nbytes
                self.static_bytes += nbytes if static else 0
                return
            if entry[0] != nbytes:  # resized in place (resize_, an out= op)
                self.current_bytes += nbytes - entry[0]
                self.static_bytes += nbytes - entry[0] if entry[2] else 0
                entry[0] = nbytes
            if static and not entry[2]:
                entry[2] = True
                self.static_bytes += nbytes

    def _see(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # a sparse or opaque tensor: no storage to count
        entry = self._live.get(storage._cdata)
        if entry is not None and entry[0] == storage.nbytes():
            return  # a view or an in-place result: nothing new
        self._add(storage)
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_static_bytes = self.static_bytes
            saved = self.saved_activations
            self.peak_saved_bytes = saved.current_bytes if saved is not None and saved.tracking else 0

    def track_static(self, tensors_fn) -> None:
        """``tensors_fn()`` returns the tensors that count as static (weights, gradient buffers,
        optimizer state); they are registered at the start of every tracked iteration."""
        self.static_source = tensors_fn

    def _register_existing(self) -> None:
        if not self.tracked_once:
            # Once: every storage Python can reach (no autograd graph is alive between iterations).
            tensor_base, strided = torch._C.TensorBase, torch.strided
            for obj in gc.get_objects():
                if issubclass(type(obj), tensor_base) and obj.device.type == "cpu" and obj.layout == strided:
                    self._add(obj.untyped_storage())
        for t in self.static_source() if self.static_source is not None else ():
            if t.device.type == "cpu":
                self._add(t.untyped_storage(), static=True)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    @contextlib.contextmanager
    def track(self, enabled: bool = True):
        """Count the storages made inside this context (on this thread); with ``enabled`` False count
        nothing (no mode, no cost) and mark the numbers as not this iteration's."""
        self.tracking = enabled
        if not enabled:
            yield self
            return
        self._register_existing()
        self.tracked_once = True
        with _CountingMode(self):
            yield self

    def stats(self) -> dict[str, int]:
        """``allocated_bytes.all.*`` (the CUDA allocator's names) and the peak's make-up: the peak since
        start once any iteration was tracked, the current bytes only when the latest one was (an
        untracked iteration's allocations are not counted)."""
        if not self.tracked_once:
            return {}
        stats = {"allocated_bytes.all.current": self.current_bytes} if self.tracking else {}
        stats["allocated_bytes.all.peak"] = self.peak_bytes
        stats["temporaries_bytes.peak"] = self.peak_bytes - self.peak_static_bytes - self.peak_saved_bytes
        return stats


# Process-wide, like torch.cuda's allocator statistics that report_memory also reads.
ALLOCATED_MEMORY = AllocatedMemoryTracker(saved_activations=ACTIVATION_MEMORY)
