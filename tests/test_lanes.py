"""The fast lane's check (tests/lanes.py): a test that starts a process without the world mark fails,
naming the mark; with the mark, or starting none, it passes; ``-m "not world"`` leaves marked ones out.
Run in a pytest of its own, which is a process: this test is a world test itself."""

from __future__ import annotations

import os

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.world
def test_an_unmarked_test_that_starts_a_process_fails(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    pytester.makeconftest('pytest_plugins = ["lanes"]\n')
    pytester.makepyfile(
        """
        import multiprocessing, subprocess, sys
        import pytest

        def test_unmarked_subprocess():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_unmarked_process():
            p = multiprocessing.get_context("spawn").Process(target=print)
            p.start()
            p.join()

        @pytest.mark.world
        def test_marked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_no_process():
            assert sum([1, 2]) == 3
        """
    )
    everything = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    everything.assert_outcomes(passed=2, failed=2)
    everything.stdout.fnmatch_lines(
        ["*test_unmarked_subprocess starts a subprocess but is not marked @pytest.mark.world*"]
    )
    everything.stdout.fnmatch_lines(
        ["*test_unmarked_process starts a process but is not marked @pytest.mark.world*"]
    )
    fast = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-m", "not world", "-k", "test_marked or no_process"
    )
    fast.assert_outcomes(passed=1, deselected=3)
