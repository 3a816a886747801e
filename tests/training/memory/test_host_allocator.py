"""CPU runs keep freed activation memory in the process (glibc malloc settings) instead of handing it
back to the kernel and faulting it in again each microbatch."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_lite.training.memory import host_allocator

REPO = Path(__file__).resolve().parents[3]
glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc settings"
)

# Frees a 20 MiB tensor (above glibc's initial 128 KiB mmap threshold) and prints how much resident
# memory that handed back to the kernel.
_RETURNED_ON_FREE = """
import torch
def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))
block = torch.ones(5 * 1024 * 1024)
held = rss()
del block
print(json.dumps({"returned": held - rss()}))
"""


def _returned_on_free(setup: str, env: dict | None = None) -> int:
    code = "import json\n" + textwrap.dedent(setup) + _RETURNED_ON_FREE
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])["returned"]


@pytest.mark.world
@glibc_only
def test_freed_block_stays_in_the_process():
    tuned = """
    from megatron_lite.training.memory.host_allocator import keep_freed_host_memory
    assert keep_freed_host_memory()
    """
    assert _returned_on_free("") >= 16 * 2**20  # glibc's defaults: the block goes back at once
    assert _returned_on_free(tuned) < 2**20


@pytest.mark.world
@glibc_only
def test_initialize_megatron_on_cpu_keeps_freed_memory():
    """The real start-up path every CPU worker takes (a world of one, gloo)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env = {**os.environ, **world, "CUDA_VISIBLE_DEVICES": ""}  # a CPU run, on any machine
    setup = """
    from megatron_lite.training.config import ConfigContainer
    from megatron_lite.training.initialize import initialize_megatron
    initialize_megatron(ConfigContainer())
    """
    assert _returned_on_free(setup, env) < 2**20


def test_other_c_libraries_are_left_alone(mocker):
    mocker.patch.object(host_allocator.platform, "libc_ver", return_value=("", ""))
    cdll = mocker.patch.object(host_allocator.ctypes, "CDLL")
    assert host_allocator.keep_freed_host_memory() is False
    cdll.assert_not_called()


@pytest.mark.world
def test_a_refused_setting_is_reported(mocker):
    mocker.patch.object(host_allocator.platform, "system", return_value="Linux")
    mocker.patch.object(host_allocator.platform, "libc_ver", return_value=("glibc", "2.35"))
    libc = mocker.patch.object(host_allocator.ctypes, "CDLL").return_value
    libc.mallopt.side_effect = [1, 0]  # glibc refuses the second value
    assert host_allocator.keep_freed_host_memory() is False
    assert [c.args for c in libc.mallopt.call_args_list] == list(host_allocator.SETTINGS)
