"""Writing a planned save from a background process (megatron-core's persistent async worker).

The pieces are first copied into shared host memory (``ShardedSavePlanner.stage``), so training may
update the weights at once; one long-lived process per rank then writes them and hands back DCP's
write results. Nothing here is collective: when every rank's write is done is decided by the caller
(``training.checkpointing.async_save``), which then runs ``SaveRequest.finish``.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing as mp

from megatron_lite.core.dist_checkpointing.pieces import SaveRequest
from megatron_lite.utils.process import die_with_parent, jobs_from_parent, name_process

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
# Fault-injection tests widen the window in which a background write is in flight.
_TEST_WRITE_DELAY_S = float(os.environ.get("MEGATRON_LITE_TEST_ASYNC_WRITE_DELAY_S", "0"))


def _writer_loop(jobs, results, parent: int) -> None:
    """The background process: write each job it is sent, until told to stop or its parent is gone
    (a parent killed with SIGKILL says nothing; its children must not outlive it)."""
    # SIGTERM / SIGINT reach the whole process group; the rank traps them to save and exit, and its
    # writer must finish that save. Started with them blocked (AsyncWriter.start), it ignores them
    # before unblocking; it still dies with its rank (parent-death signal, ppid check).
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    die_with_parent()
    name_process("ckpt-writer")
    buffers: dict = {}
    for job in jobs_from_parent(jobs, parent):
        request, sent = ForkingPickler.loads(job)
        buffers = sent if sent is not None else buffers
        try:
            request.planner.attach(buffers)
            if _TEST_WRITE_DELAY_S:
                time.sleep(_TEST_WRITE_DELAY_S)
            results.put(("done", request.write()))
        except Exception as err:  # a full disk, a lost mount: the caller reports it as one line
            results.put(("failed", f"{type(err).__name__}: {err}".splitlines()[0]))


class AsyncWriter:
    """One rank's background writer process, started on the first save and kept (the staging buffers
    too) for the next ones. One write in flight at a time."""

    def __init__(self):
        self._process = None
        self._buffers: dict = {}
        self._sent = False  # whether the running writer process holds the buffers
        self._pending = False

    def start(self) -> None:
        """Start the background process now (it takes seconds to import torch), if not running."""
        if self._process is not None and self._process.is_alive():
            return
        self._sent = False
        ctx = mp.get_context("spawn")
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        self._process = ctx.Process(
            target=_writer_loop, args=(self._jobs, self._results, os.getpid()), daemon=True
        )
        # Blocked, not ignored, while the child starts: it inherits the mask, and this rank still
        # gets a signal sent meanwhile once it unblocks.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            self._process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def submit(self, request: SaveRequest) -> None:
        """Stage ``request``'s pieces into shared memory and hand it to the background process."""
        assert not self._pending, "the previous background write has not been collected"
        self.start()
        # The shared buffers cross to the writer only when new: handing over hundreds of tensors
        # (a file descriptor each) would cost the training process every save.
        fresh = request.planner.stage(self._buffers) or not self._sent
        # Pickled here, not in the queue's feeder thread, where a failure would vanish unreported.
        self._jobs.put(bytes(ForkingPickler.dumps((request, self._buffers if fresh else None))))
        self._sent, self._pending = True, True

    def poll(self, timeout: float | None = 0.0):
        """``None`` while the write runs; then ``("done", results)`` or ``("failed", reason)`` once.
        ``timeout`` None waits for the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                outcome = self._results.get(
                    timeout=0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
                )
            except queue.Empty:
                if not self._process.is_alive():
                    outcome = (
                        "failed",
                        f"the background checkpoint writer died (exit code {self._process.exitcode})",
                    )
                elif deadline is None or time.monotonic() < deadline:
                    continue
                else:
                    return None
            self._pending = False
            return outcome

    def close(self) -> None:
        """Stop the background process: at once when a write is still in flight (the job is ending
        without committing it, so its files are of no use), else once it has read the request to stop."""
        if self._process is not None and self._process.is_alive():
            if not self._pending:
                self._jobs.put(None)
                self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._process, self._pending = None, False
