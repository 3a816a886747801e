"""A write that fails part-way (a full disk) is one line, leaves no temporary and loses nothing.

The disk is real. Where the tests run as root and may mount, it is a size-limited tmpfs and writes
fail with ENOSPC. Elsewhere the kernel's per-process file size limit (RLIMIT_FSIZE, which Python
turns into EFBIG rather than a signal) makes the same writes fail part-way; nothing is mocked either way.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_helpers import tree_digest
from dist_helpers import PRETRAIN, REPO, SMALL_MODEL, loss_lines, ok, run_pretrain

pytestmark = pytest.mark.world  # every test here starts processes

ITERS = [*SMALL_MODEL, "--train-iters", "6", "--log-interval", "1"]


def _mount_tmpfs(directory: Path, options: str) -> bool:
    """Whether a tmpfs with ``options`` is now mounted at ``directory`` (root, with mount(8), in a
    namespace that allows it)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)]
    return subprocess.run(mount, capture_output=True).returncode == 0


@contextlib.contextmanager
def small_filesystem(directory: Path, size: int):
    """A tmpfs of ``size`` bytes at ``directory``; yields False where this process may not mount one."""
    directory.mkdir()
    mounted = _mount_tmpfs(directory, f"size={size}")
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)


def _pretrain(args: list[str], cwd: Path, file_size_limit: int | None = None):
    """pretrain.py ARGS; with ``file_size_limit``, in a process of its own under that RLIMIT_FSIZE."""
    if file_size_limit is None:
        return run_pretrain(args, cwd)

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, PRETRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
        preexec_fn=limit,
    )  # fmt: skip


def _files_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_a_full_disk_mid_save_is_one_line_and_the_previous_checkpoint_resumes_exactly(tmp_path):
    straight = ok(_pretrain([*ITERS, "--save", "ref", "--save-interval", "2"], tmp_path))
    one_save = _files_bytes(tmp_path / "ref" / "iter_0000002")
    shard = max(p.stat().st_size for p in (tmp_path / "ref" / "iter_0000002").rglob("*.pt"))
    # Room for the first checkpoint, not for a second beside it.
    with small_filesystem(tmp_path / "disk", size=one_save * 3 // 2) as mounted:
        ckpt = tmp_path / "disk" / "ckpt"
        ok(_pretrain([*ITERS, "--save", str(ckpt), "--save-interval", "2", "--exit-interval", "2"], tmp_path))
        before = tree_digest(ckpt)
        failed = _pretrain(
            [*ITERS, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "2"],
            tmp_path,
            file_size_limit=None if mounted else shard // 2,
        )
        assert failed.returncode != 0
        lines = failed.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr
        reason = "No space left on device (ENOSPC)" if mounted else "File too large (EFBIG)"
        assert lines[0].startswith(f"pretrain.py: error: --save {ckpt}: iteration 4 not saved"), lines[0]
        assert reason in lines[0] and "it needs " in lines[0] and " free" in lines[0], lines[0]
        assert "the previous checkpoint and latest_checkpointed_iteration.txt are untouched" in lines[0]
        assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
        assert tree_digest(ckpt) == before
        resumed = ok(_pretrain([*ITERS, "--load", str(ckpt)], tmp_path))
    assert {it: loss_lines(straight.stdout)[it] for it in range(3, 7)} == loss_lines(resumed.stdout)


_WRITE_TWICE = """
import sys
from megatron_lite.utils.atomic_io import WriteFailedError, atomic_write_bytes
path = sys.argv[1]
atomic_write_bytes(path, lambda f: f.write(b"previous"))
try:
    atomic_write_bytes(path, lambda f: [f.write(b"x" * 65536) for _ in range(64)], 64 * 65536)
except WriteFailedError as err:
    print(err)
"""


def test_a_failed_atomic_write_keeps_the_previous_file_and_no_temporary(tmp_path):
    """The writer the data-index caches, post-mortems and snapshots share."""
    with small_filesystem(tmp_path / "disk", size=1 << 20) as mounted:
        target = tmp_path / "disk" / "file.bin"
        result = subprocess.run(
            [sys.executable, "-c", _WRITE_TWICE, str(target)], cwd=REPO, capture_output=True, text=True,
            timeout=60, preexec_fn=None if mounted else (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20,) * 2)),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        line = result.stdout.strip()
        assert line.startswith(f"cannot write {target}: ") and "it needs 4.0 MB" in line, line
        assert target.read_bytes() == b"previous"
        assert os.listdir(target.parent) == ["file.bin"]


@contextlib.contextmanager
def read_only_directory(directory: Path):
    """A read-only tmpfs where this process may mount one (root writes anywhere else), else a
    directory without write permission. Yields the error a write there gets."""
    directory.mkdir()
    mounted = _mount_tmpfs(directory, "ro,size=1m")
    if not mounted:
        directory.chmod(0o555)
    try:
        yield "Read-only file system (EROFS)" if mounted else "Permission denied (EACCES)"
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)
        directory.chmod(0o755)


def test_a_read_only_save_directory_is_one_line(tmp_path):
    with read_only_directory(tmp_path / "ckpt") as reason:
        argv = [*SMALL_MODEL, "--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
        result = _pretrain(argv, tmp_path)
        assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "iteration 2 not saved" in result.stderr and reason in result.stderr, result.stderr
        assert list((tmp_path / "ckpt").iterdir()) == []
