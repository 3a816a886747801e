"""megatron-core's asynchronous calls (``dist_checkpointing.strategies.async_utils``): an
``AsyncRequest`` is a function to run in another process and the functions every rank runs once all
ranks' calls are done (``finalize_fns``, collective). A ``TemporalAsyncCaller`` forks one process per
call, a ``PersistentAsyncCaller`` keeps one worker for all of them; ``AsyncCallsQueue`` schedules
requests and finalizes those done. (megatron_lite's own training loop writes through
``background_writer`` instead, with its staging buffers kept between saves.)"""

from __future__ import annotations

import logging
import os
import queue
import signal
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import NamedTuple

import torch
import torch.multiprocessing as mp

from megatron_lite.core.dist_checkpointing.core import CheckpointingException
from megatron_lite.core.process_group_utils import get_collective_device
from megatron_lite.utils.process import die_with_parent, jobs_from_parent

logger = logging.getLogger(__name__)


class AsyncRequest(NamedTuple):
    """``async_fn(*async_fn_args, **async_fn_kwargs)`` runs in another process (None: nothing to run);
    then every rank runs ``finalize_fns`` in order. ``preload_fn`` stages data before the call (run
    here); ``call_idx`` orders the calls; a frozen request takes no more finalize functions."""

    async_fn: Callable | None
    async_fn_args: tuple
    finalize_fns: list[Callable]
    async_fn_kwargs: dict = {}
    preload_fn: Callable | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable) -> None:
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """What the asynchronous path does, here and now. Collective (a barrier, then finalize)."""
        if self.preload_fn is not None:
            self.preload_fn()
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        torch.distributed.barrier()
        for finalize_fn in self.finalize_fns:
            finalize_fn()

    def freeze(self) -> AsyncRequest:
        return self._replace(is_frozen=True)


def _run(request: AsyncRequest) -> None:
    if request.async_fn is not None:
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)


def _rank() -> int | str:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else "?"


class AsyncCaller(ABC):
    """Runs one request at a time in another process and tells, on every rank at once, when every
    rank's call is done."""

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Start ``async_req``'s function in another process."""

    @abstractmethod
    def _poll(self, blocking: bool) -> tuple[bool, str | None]:
        """(done, this rank's failure or None)."""

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Whether the current call is done on every rank (on this one with ``no_dist``). Collective
        unless ``no_dist``; a failure on any rank is a CheckpointingException on every rank."""
        done, failure = self._poll(blocking)
        if no_dist:
            if failure:
                raise CheckpointingException(f"rank {_rank()}: {failure}")
            return done
        # note: a blocking collective; it is what makes "done" the same answer on every rank
        flags = torch.tensor(
            [int(not done), int(failure is not None)], dtype=torch.int, device=get_collective_device()
        )
        torch.distributed.all_reduce(flags)
        if flags[1]:
            raise CheckpointingException(
                f"an asynchronous checkpoint call failed on {int(flags[1])} rank(s)"
                + (f"; rank {_rank()}: {failure}" if failure else "")
            )
        return bool(flags[0] == 0)

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Stop the process(es): at once with ``abort``, else after the current call."""


class TemporalAsyncCaller(AsyncCaller):
    """A forked process per call."""

    def __init__(self):
        self.process: mp.Process | None = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.preload_fn is not None:
            async_req.preload_fn()
        if async_req.async_fn is None:
            return
        # fork: the child sees this process's tensors as they are now, with no copy to send
        self.process = mp.get_context("fork").Process(target=_run, args=(async_req,), daemon=True)
        self.process.start()

    def _poll(self, blocking: bool) -> tuple[bool, str | None]:
        if self.process is None:
            return True, None
        if blocking:
            self.process.join()
        if self.process.is_alive():
            return False, None
        code, self.process = self.process.exitcode, None
        return True, None if code == 0 else f"the asynchronous call exited with code {code}"

    def close(self, abort: bool = False) -> None:
        if self.process is not None:
            if abort:
                self.process.kill()
            self.process.join()
            self.process = None
        logger.debug("rank %s: TemporalAsyncCaller closed", _rank())


def _worker_loop(jobs, done, parent: int) -> None:
    """The persistent worker: run each call it is sent, until sent None or its parent is gone (a rank
    killed with SIGKILL says nothing). SIGTERM / SIGINT are its rank's to handle: the worker finishes
    the write in flight (as training's background writer)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()
    for job in jobs_from_parent(jobs, parent):
        idx, fn, args, kwargs = ForkingPickler.loads(job)
        try:
            fn(*args, **kwargs)
            done.put((idx, None))
        except Exception as err:  # reported by every rank's next check
            done.put((idx, f"{type(err).__name__}: {err}".splitlines()[0]))


class PersistentAsyncCaller(AsyncCaller):
    """One worker process, started on the first call and kept for the next ones."""

    def __init__(self):
        self.process: mp.Process | None = None
        self.jobs = self.done = None
        self.current: int | None = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.preload_fn is not None:
            async_req.preload_fn()
        if self.process is None or not self.process.is_alive():
            ctx = mp.get_context("fork")
            self.jobs, self.done = ctx.Queue(), ctx.Queue()
            self.process = ctx.Process(
                target=_worker_loop, args=(self.jobs, self.done, os.getpid()), daemon=True
            )
            self.process.start()
        self.current = async_req.call_idx
        if async_req.async_fn is None:
            self.done.put((async_req.call_idx, None))
            return
        # The call only (finalize functions stay here), pickled now, not in the queue's feeder thread
        # where a failure would vanish unreported.
        job = (async_req.call_idx, async_req.async_fn, async_req.async_fn_args, async_req.async_fn_kwargs)
        self.jobs.put(bytes(ForkingPickler.dumps(job)))

    def _poll(self, blocking: bool) -> tuple[bool, str | None]:
        while self.current is not None:
            try:
                idx, failure = self.done.get(timeout=0.5 if blocking else 0.0)
            except queue.Empty:
                if not self.process.is_alive():
                    self.current = None
                    return True, f"the asynchronous worker died (exit code {self.process.exitcode})"
                if blocking:
                    continue
                return False, None
            if idx == self.current:
                self.current = None
                return True, failure
        return True, None

    def close(self, abort: bool = False) -> None:
        if self.process is not None:
            if self.process.is_alive() and not abort:
                self.jobs.put(None)
                self.process.join(timeout=60)
            if self.process.is_alive():
                self.process.kill()
            self.process.join()
            self.process = None
        self.current = None
        logger.debug("rank %s: PersistentAsyncCaller closed", _rank())

    def __del__(self):
        # As upstream: the worker finishes its call and stops (a caller dropped mid-write keeps it).
        try:
            self.close()
        except Exception:  # at interpreter shutdown anything may already be gone
            pass


class _ActiveAsyncRequest(NamedTuple):
    idx: int
    async_caller: AsyncCaller
    async_request: AsyncRequest


class AsyncCallsQueue:
    """Requests in flight, finalized in the order they were scheduled. Every method but
    ``get_num_unfinalized_calls`` is collective."""

    def __init__(self, persistent: bool = False):
        self.async_calls: deque[_ActiveAsyncRequest] = deque()
        self.call_idx = -1
        self.persistent = persistent
        self.persistent_caller: PersistentAsyncCaller | None = None

    def _get_async_caller(self) -> AsyncCaller:
        if not self.persistent:
            return TemporalAsyncCaller()
        if self.persistent_caller is None:
            self.persistent_caller = PersistentAsyncCaller()
        return self.persistent_caller

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request``; returns its index (what ``maybe_finalize_async_calls`` reports)."""
        self.call_idx += 1
        request = async_request._replace(call_idx=self.call_idx).freeze()
        caller = self._get_async_caller()
        caller.schedule_async_call(request)
        self.async_calls.append(_ActiveAsyncRequest(self.call_idx, caller, request))
        return self.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the calls done on every rank (all of them, waiting, with ``blocking``); returns
        their indices."""
        finalized: list[int] = []
        while self.async_calls and self.async_calls[0].async_caller.is_current_async_call_done(
            blocking, no_dist
        ):
            idx, _, request = self.async_calls.popleft()
            for finalize_fn in request.finalize_fns:
                finalize_fn()
            if not no_dist:
                check = torch.tensor([idx], dtype=torch.int, device=get_collective_device())
                torch.distributed.all_reduce(check, op=torch.distributed.ReduceOp.MAX)
                if int(check) != idx:
                    raise CheckpointingException("ranks finalized different asynchronous calls")
            finalized.append(idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        """Finalize what is in flight (drop it with ``abort``), then stop the worker."""
        try:
            if not abort:
                self.maybe_finalize_async_calls(blocking=True)
        finally:  # a failed finalize still stops the processes
            for _, caller, _ in self.async_calls:
                caller.close(abort=True)
            self.async_calls.clear()
            if self.persistent_caller is not None:
                self.persistent_caller.close(abort=abort)
                self.persistent_caller = None
