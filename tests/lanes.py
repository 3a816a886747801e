"""The fast lane: ``make test-fast`` runs the tests that start no process (``-m "not world"``).

A test that starts one (a pretrain.py job and its workers, a spawned gloo world, any subprocess or
multiprocessing child) is marked ``@pytest.mark.world``. The mark is checked, not trusted: a test
without it that starts a process fails, naming the mark, so the fast lane stays free of worlds.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest

_unmarked: list[str | None] = [None]  # the running test's id while it has no world mark

_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _refuse(what: str) -> None:
    if _unmarked[0] is not None:
        raise RuntimeError(
            f"{_unmarked[0]} starts {what} but is not marked @pytest.mark.world (the fast lane runs "
            "only tests that start no process)"
        )


def _checked_popen_init(self, *args, **kwargs):
    _refuse("a subprocess")
    _popen_init(self, *args, **kwargs)


def _checked_process_start(self):
    _refuse("a process")
    _process_start(self)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "world: starts processes (a job and its workers, a gloo world, a subprocess); "
        "make test-fast leaves these out"
    )  # fmt: skip
    subprocess.Popen.__init__ = _checked_popen_init
    multiprocessing.process.BaseProcess.start = _checked_process_start


def pytest_unconfigure(config) -> None:
    subprocess.Popen.__init__ = _popen_init
    multiprocessing.process.BaseProcess.start = _process_start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _unmarked[0] = None if item.get_closest_marker("world") else item.nodeid
    try:
        yield
    finally:
        _unmarked[0] = None
