"""A pretrain.py job run in the background, and its worker processes as /proc shows them: for the tests
that stop, kill or watch a running job (the launcher, checkpoint saves interrupted mid-write)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from dist_helpers import PRETRAIN


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def rank_of(pid: int) -> int:
    """A forked worker is named rank-<r>; a started one (torchrun-style) has RANK in its environment."""
    with open(f"/proc/{pid}/comm") as f:
        name = f.read().strip()
    if name.startswith("rank-"):
        return int(name[len("rank-") :])
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Job:
    """A pretrain.py job whose stdout is collected in the background."""

    def __init__(self, args, cwd):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        self.proc = subprocess.Popen(
            [sys.executable, PRETRAIN, *args],
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(
                target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True
            ).start()

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.out):
            assert self.proc.poll() is None, "".join(self.err)
            assert time.monotonic() < deadline, f"no {text!r} in output"
            time.sleep(0.1)
