"""Start a job's worker processes on this machine, stream their output, and stop them together.

Used by ``pretrain.py`` when it is not already under torchrun. Workers get torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT). If any worker fails, by exception or by signal, the
others are stopped within seconds and the launcher exits non-zero, printing the failing rank's error
once. SIGINT / SIGTERM are forwarded to every worker. Failure handling never waits on output: a
stalled reader of the launcher's stdout (a full pipe, a stuck log shipper) can slow the workers down,
but cannot keep a failed job up.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from megatron_lite.training.forked_worker import ForkedWorker
from megatron_lite.utils.process import die_with_parent

ERROR_FILE_ENV = "MEGATRON_LITE_ERROR_FILE"
_GRACE_AFTER_FAILURE_S = 3.0
_GRACE_AFTER_SIGNAL_S = 60.0
_DRAIN_S = 2.0  # how long a finished job waits for its last lines to be written
_QUEUED_LINES = 1024  # per sink; beyond that the workers wait on their own pipes
# Errors that only say a peer went away: symptoms of another rank's failure, not the cause.
_SECONDARY = (
    "Connection closed by peer",
    "Connection reset",
    "Broken pipe",
    "ECONNRESET",
    "timed out",
    "another rank failed",
    "closed its shared-memory channel",  # core/pipeline_parallel/shared_memory_p2p.py: a neighbour exited
)


def report_error(message: str) -> None:
    """In a worker: hand an error line to the launcher (which prints it once, the first failing rank's),
    or print it when no launcher started this worker (torchrun)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        with open(path, "w") as f:
            f.write(message + "\n")
    else:
        print(message, file=sys.stderr, flush=True)


def worker_exit_code(prog: str, body, expected: tuple[type[BaseException], ...]) -> int:
    """A tool's worker: run ``body()``; 0 when it returns, 2 and one line (``PROG: error: ...``) for
    an ``expected`` error, 1 and the traceback for any other."""
    try:
        body()
    except expected as err:
        report_error(f"{prog}: error: {err}")
        return 2
    except Exception:
        import traceback

        report_error(f"{prog}: rank {os.environ.get('RANK', '?')} failed:\n{traceback.format_exc().rstrip()}")
        return 1
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Output:
    """One writer thread per sink. Pump threads queue whole lines; only this thread writes, straight
    to the file descriptor, so a write blocked on a stalled reader holds no lock and no Python buffer
    that anything else (the failure path, interpreter exit) would wait for."""

    def __init__(self, sink):
        self.sink = sink
        self.queue: queue.Queue[str | None] = queue.Queue(maxsize=_QUEUED_LINES)
        try:
            sink.flush()
            self.fd: int | None = sink.fileno()
        except (AttributeError, OSError, ValueError):
            self.fd = None  # not a real file (e.g. captured): write through the object
        self.thread = threading.Thread(target=self._write_lines, daemon=True)
        self.thread.start()

    def write(self, text: str, timeout: float | None = None) -> None:
        """Queue ``text``; waits while the queue is full (at most ``timeout`` seconds, then drops it)."""
        try:
            self.queue.put(text, timeout=timeout)
        except queue.Full:
            pass

    def close(self, deadline: float) -> None:
        """Let queued lines out until ``deadline`` (time.monotonic()); then give up on them."""
        try:
            self.queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return
        self.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _write_lines(self) -> None:
        broken = False
        while (text := self.queue.get()) is not None:
            if broken:
                continue  # keep draining so producers never wait on a closed reader
            try:
                if self.fd is None:
                    self.sink.write(text)
                    self.sink.flush()
                    continue
                data = text.encode(errors="replace")
                while data:
                    data = data[os.write(self.fd, data) :]
            except (BrokenPipeError, OSError, ValueError):
                broken = True


class Launcher:
    def __init__(self, command: list[str], nproc: int, entry=None):
        self.command, self.nproc = command, nproc
        # entry(argv) -> exit code runs ``command``'s worker in a forked process, when that is safe.
        self.entry = entry if entry is not None and _can_fork() else None
        self.procs: list = []
        self.error_dir = tempfile.mkdtemp(prefix="megatron_lite_")
        self.stdout: _Output | None = None
        self.stderr: _Output | None = None
        self.stopping: int | None = None  # signal number once the user asked to stop

    def _env(self, rank: int, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.nproc),
            LOCAL_WORLD_SIZE=str(self.nproc),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONUNBUFFERED="1",
        )
        env[ERROR_FILE_ENV] = os.path.join(self.error_dir, f"rank_{rank}.err")
        # Like torchrun: share the cores instead of every worker spinning up a thread per core.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.nproc)))
        return env

    def _pump(self, rank: int, stream, output: _Output) -> None:
        prefix = "" if rank == self.nproc - 1 else f"[rank {rank}] "
        for line in iter(stream.readline, ""):
            output.write(line if (not prefix or line.startswith("[Rank ")) else prefix + line)
        stream.close()

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def _stop_all(self, grace: float) -> None:
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def _on_signal(self, signum, frame) -> None:
        if self.stopping is not None:  # second Ctrl-C: stop now
            self._signal_all(signal.SIGKILL)
            return
        self.stopping = signum
        self._signal_all(signal.SIGTERM)

    def _describe(self, rank: int, code: int) -> tuple[str, bool]:
        """The failing rank's message, and whether it is only a symptom of another rank's failure."""
        path = os.path.join(self.error_dir, f"rank_{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                text = f.read().rstrip()
            return text, any(s in text for s in _SECONDARY)
        if code < 0:
            return f"pretrain.py: rank {rank} was killed by {signal.Signals(-code).name}", False
        return f"pretrain.py: rank {rank} exited with code {code}", True

    def run(self) -> int:
        port = _free_port()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        threads = []
        try:
            for rank in range(self.nproc):
                if self.entry is not None:
                    inherited = [f.fileno() for p in self.procs for f in (p.stdout, p.stderr)]
                    env = self._env(rank, port)
                    self.procs.append(ForkedWorker(self.entry, self.command[2:], env, inherited))
                    continue
                self.procs.append(
                    subprocess.Popen(
                        self.command,
                        env=self._env(rank, port),
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        bufsize=1,
                        start_new_session=True,
                        preexec_fn=die_with_parent,
                    )
                )
            # The writer threads start after the forks: a forked worker inherits no thread.
            self.stdout, self.stderr = _Output(sys.stdout), _Output(sys.stderr)
            for rank, p in enumerate(self.procs):
                for stream, output in ((p.stdout, self.stdout), (p.stderr, self.stderr)):
                    t = threading.Thread(target=self._pump, args=(rank, stream, output), daemon=True)
                    t.start()
                    threads.append(t)
            return self._monitor()
        finally:
            self._stop_all(0.5)
            deadline = time.monotonic() + _DRAIN_S
            for t in threads:  # a pump waiting on a full queue is left behind (daemon)
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            for output in (self.stdout, self.stderr):
                if output is not None:
                    output.close(deadline)
            for s, handler in previous.items():
                signal.signal(s, handler)
            shutil.rmtree(self.error_dir, ignore_errors=True)

    def _monitor(self) -> int:
        stop_deadline = None
        while True:
            codes = [p.poll() for p in self.procs]
            if self.stopping is not None:
                stop_deadline = stop_deadline or time.monotonic() + _GRACE_AFTER_SIGNAL_S
                if all(c is not None for c in codes) or time.monotonic() > stop_deadline:
                    self._stop_all(0.0)
                    clean = all(c == 0 for c in codes)
                    return 0 if clean else 128 + self.stopping
            else:
                failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    return self._fail(failed)
                if all(c == 0 for c in codes):
                    return 0
            time.sleep(0.05)

    def _fail(self, failed: list[tuple[int, int]]) -> int:
        self._stop_all(_GRACE_AFTER_FAILURE_S)
        described = [(rank, code, *self._describe(rank, code)) for rank, code in failed]
        rank, code, message, _ = sorted(described, key=lambda d: (d[3], d[0]))[0]
        self.stderr.write(message + "\n", timeout=_DRAIN_S)
        return code if code > 0 else 128 - code


def _can_fork() -> bool:
    """Forking is safe while this process has no other thread and no CUDA context (Linux/macOS)."""
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def launch(command: list[str], nproc: int, entry=None) -> int:
    """Run ``command`` as ``nproc`` workers of one job; returns the job's exit code. With ``entry``
    (``entry(command[2:])`` does what running ``command`` would) the workers are forked from this
    process instead of started afresh."""
    return Launcher(command, nproc, entry).run()
