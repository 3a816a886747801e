"""A job's worker forked from the launcher (training/launcher.py), which has already imported torch and
the framework."""

from __future__ import annotations

import os
import signal
import sys

from megatron_lite.utils.process import die_with_parent, name_process


class ForkedWorker:
    """A worker forked from the launcher, which has already imported torch and the framework: it starts
    in milliseconds instead of re-importing them (seconds per worker, all on the same cores). The
    subset of subprocess.Popen the launcher uses: pid, stdout, stderr, poll(), wait()."""

    def __init__(self, entry, argv: list[str], env: dict[str, str], inherited: list[int]):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the worker
            code = 1
            try:
                os.setsid()
                die_with_parent()
                name_process(f"rank-{env['RANK']}")
                for fd, target in ((out_w, 1), (err_w, 2)):
                    os.dup2(fd, target)
                for fd in (out_r, out_w, err_r, err_w, *inherited):  # and the other workers' pipes
                    os.close(fd)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.environ.clear()
                os.environ.update(env)
                import torch

                # OpenMP read OMP_NUM_THREADS when torch was imported, in the launcher.
                torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
                code = entry(argv)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(out_w)
        os.close(err_w)
        self.stdout = os.fdopen(out_r, "r", buffering=1, errors="replace")
        self.stderr = os.fdopen(err_r, "r", buffering=1, errors="replace")
        self.returncode: int | None = None

    def _status(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._status(os.WNOHANG)

    def wait(self) -> int:
        return self._status(0)
