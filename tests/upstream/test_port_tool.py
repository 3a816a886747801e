"""tools/port_upstream_tests.py, the check that runs upstream's own unit tests against megatron_lite:
what its port changes in a file, and that a multi-rank test failing on one rank ends its world within
the timeout instead of hanging (the tests that finished are still counted)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "port_upstream_tests.py"


@pytest.fixture(scope="module")
def port():
    spec = importlib.util.spec_from_file_location("port_upstream_tests", _TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_port_changes_only_the_prefix_and_guards_each_name(port):
    ported = port.port_source(
        "from megatron.core.utils import is_te_min_version, no_such_name\n"
        "from megatron.bridge.models.conversion.param_mapping import DirectMapping\n"
        "import pytest\n\n"
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='cuda')\n"
        "def test_x():\n    assert is_te_min_version('0.0.0')\n"
    )
    assert "megatron.core" not in ported and "megatron.bridge" not in ported
    assert "from megatron_lite.core.utils import is_te_min_version as is_te_min_version" in ported
    assert "from megatron_lite.bridge.models.conversion.param_mapping import DirectMapping" in ported
    assert "skipif" not in ported  # a CUDA-only skip goes; the test runs on CPU
    namespace: dict = {}
    exec(compile(ported.replace("@pytest", "#"), "ported", "exec"), namespace)
    with pytest.raises(ImportError, match="megatron_lite lacks megatron_lite.core.utils.no_such_name"):
        namespace["no_such_name"]()


_HANGS_WITHOUT_TIMEOUT = """
import torch.distributed as dist
from tests.unit_tests.test_utilities import Utils


def test_fails_on_one_rank_before_a_collective():
    Utils.initialize_distributed()
    assert Utils.rank == 0, "rank 1 leaves before the barrier"
    dist.barrier()  # rank 0 waits here for a rank that never comes


def test_after():
    dist.barrier()
"""


@pytest.mark.world
def test_a_rank_failing_a_test_cannot_hang_the_world(port, tmp_path, monkeypatch):
    upstream = tmp_path / "lm"
    (upstream / "tests" / "unit_tests").mkdir(parents=True)
    (upstream / "tests" / "unit_tests" / "test_hang.py").write_text(_HANGS_WITHOUT_TIMEOUT)
    monkeypatch.setenv("PORT_PG_TIMEOUT_S", "5")
    spec = port.UpstreamFile("lm", "tests/unit_tests/test_hang.py", world_size=2)
    started = time.monotonic()
    result = port.run_file("test_hang", spec, {"lm": upstream}, tmp_path / "out", False, timeout_s=240)
    elapsed = time.monotonic() - started
    assert elapsed < 120, f"the world took {elapsed:.0f} s to end"
    assert result["in_scope"] == 2 and result["passed"] == 0
    assert any("test_fails_on_one_rank_before_a_collective" in n for n in result["failed"])
