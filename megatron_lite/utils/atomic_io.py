"""Files written whole or not at all: a reader (or a crash) never sees half of one, and a write that
fails (a full disk, a quota, an I/O error, a read-only directory) leaves no temporary behind and
raises one line naming the file, the reason and the space it needed."""

from __future__ import annotations

import errno
import os
import shutil


class WriteFailedError(OSError):
    """A file that could not be written whole; ``str(err)`` is one line. The previous file, if any,
    is untouched and the temporary is removed."""

    def __init__(self, path: str, cause: OSError, needed: int | None):
        super().__init__(cause.errno, cause.strerror)
        self.path, self.needed = path, needed
        directory = os.path.dirname(os.path.abspath(path))
        space = f"; it needs {format_bytes(needed)}" if needed is not None else ""
        free = _free_bytes(directory)
        if free is not None:
            space += f", {format_bytes(free)} free on its filesystem"
        self.message = f"cannot write {path}: {os_error_reason(cause)}{space}"

    def __str__(self) -> str:
        return self.message


def os_error_reason(err: OSError) -> str:
    """``No space left on device (ENOSPC)``: the reason, and the errno's name to search for."""
    code = errno.errorcode.get(err.errno, "") if err.errno else ""
    return f"{err.strerror or err}" + (f" ({code})" if code else "")


def write_error_line(err: OSError) -> str:
    """One line for any failed write: WriteFailedError's own, else the file and the reason."""
    if isinstance(err, WriteFailedError):
        return str(err)
    return f"cannot write {err.filename}: {os_error_reason(err)}" if err.filename else os_error_reason(err)


def format_bytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _free_bytes(directory: str) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


class _RecordingFile:
    """The file as a writer sees it, keeping the first OSError its ``write`` raised: torch.save turns
    that into a RuntimeError about stream positions, which would hide a full disk."""

    def __init__(self, f):
        self._f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self._f.flush()


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, write, needed: int | None = None) -> None:
    """``write(f)`` into a temporary file beside ``path``, flushed to disk, then renamed onto it.

    ``needed``: about how many bytes ``write`` produces, named in the error when the write fails.
    Raises WriteFailedError; other errors of ``write`` propagate, the temporary removed either way.
    """
    tmp = f"{path}.tmp.{os.getpid()}"
    recording = None
    try:
        with open(tmp, "wb") as f:
            recording = _RecordingFile(f)
            write(recording)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException as err:
        try:
            os.remove(tmp)
        except OSError:
            pass
        cause = err if isinstance(err, OSError) else (recording.error if recording else None)
        if cause is not None and not isinstance(err, WriteFailedError):
            raise WriteFailedError(path, cause, needed) from None
        raise


def replace_directory(complete: str, final: str, stale_suffix: str = ".old") -> None:
    """Put the directory ``complete`` at ``final`` (same filesystem); an existing ``final`` is moved
    aside and removed only once the new one is in place, and put back if the rename fails."""
    fsync_dir(complete)
    if os.path.exists(final):
        stale = final + stale_suffix
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        try:
            os.replace(complete, final)
        except OSError:
            os.replace(stale, final)
            raise
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(complete, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
