"""What the checkpoint tests share: the small run they save and resume, a digest of a directory tree
(to show a refused load or a failed save left it as it was) and the check of a refused load."""

from __future__ import annotations

import hashlib
import os

from dist_helpers import SMALL_MODEL, run_pretrain

BASE = [*SMALL_MODEL, "--train-iters", "12", "--log-interval", "1"]


def tree_digest(root) -> str:
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def refused(root, args, needle):
    """A load of ``ckpt`` under ``root`` with ``args`` fails with one line holding ``needle``, writing nothing."""
    before = tree_digest(root / "ckpt")
    result = run_pretrain([*BASE, *args, "--load", "ckpt", "--save", "ckpt"], root, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr and "iteration " not in result.stdout
    assert tree_digest(root / "ckpt") == before  # nothing overwritten
    return lines[0]
