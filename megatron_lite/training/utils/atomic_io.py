"""Files written whole or not at all: a reader (or a crash) never sees half of one."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, write) -> None:
    """``write(f)`` into a temporary file beside ``path``, flushed to disk, then renamed onto it."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
