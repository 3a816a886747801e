"""Run upstream's own unit tests against megatron_lite, changing only the import prefix.

A porting check, not part of the suite: it needs local checkouts (or bare git mirrors) of Megatron-LM
and Megatron-Bridge, which CI does not have. For each upstream test file we mirror it

1. rewrites ``megatron.bridge`` -> ``megatron_lite``, ``megatron.core`` / ``megatron.training`` ->
   ``megatron_lite.core`` / ``megatron_lite.training``;
2. removes CUDA-only skips (``skipif`` decorators and ``pytestmark`` that mention cuda);
3. makes each module-level import name by name, so one name we lack fails only the tests that use it
   instead of the whole file;
4. runs the file with pytest (Megatron-LM's files in a real gloo world of ``world_size`` processes
   under torchrun, with our own CPU ``tests.unit_tests.test_utilities.Utils``), deselecting the tests
   listed in ``upstream_tests_scope/<name>.json`` with the reason (a real GPU, or a feature megatron_lite does not have).

It prints, per file and in total, how many in-scope tests pass. Nothing it writes goes into the
project: the ported copies live under ``--out`` (default: a temporary directory).

    python tools/port_upstream_tests.py --megatron-lm PATH --megatron-bridge PATH [--only NAME ...]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class UpstreamFile:
    repo: str
    """"lm" (Megatron-LM) or "bridge" (Megatron-Bridge)."""
    path: str
    world_size: int = 1


GPU = "needs a real GPU"

FILES: dict[str, UpstreamFile] = {
    "test_state": UpstreamFile("bridge", "tests/unit_tests/training/test_state.py"),
    "test_train_utils": UpstreamFile("bridge", "tests/unit_tests/training/utils/test_train_utils.py"),
    "test_config": UpstreamFile("bridge", "tests/unit_tests/training/test_config.py"),
    "test_parallel_state": UpstreamFile("lm", "tests/unit_tests/test_parallel_state.py", world_size=8),
    "test_cross_entropy": UpstreamFile("lm", "tests/unit_tests/tensor_parallel/test_cross_entropy.py", 8),
    "test_data": UpstreamFile("lm", "tests/unit_tests/tensor_parallel/test_data.py", 8),
    "test_initialization": UpstreamFile("lm", "tests/unit_tests/tensor_parallel/test_initialization.py", 8),
    "test_layers": UpstreamFile("lm", "tests/unit_tests/tensor_parallel/test_layers.py", 8),
    "test_mappings": UpstreamFile("lm", "tests/unit_tests/tensor_parallel/test_mappings.py", 8),
    "test_random": UpstreamFile("lm", "tests/unit_tests/tensor_parallel/test_random.py", 8),
    "test_tensor_parallel_utils": UpstreamFile(
        "lm", "tests/unit_tests/tensor_parallel/test_tensor_parallel_utils.py", 8
    ),
    "test_tp_attrs_without_init": UpstreamFile(
        "lm", "tests/unit_tests/tensor_parallel/test_tp_attrs_without_init.py", 8
    ),
    "test_schedules": UpstreamFile("lm", "tests/unit_tests/pipeline_parallel/test_schedules.py", 8),
    "test_mapping": UpstreamFile("lm", "tests/unit_tests/dist_checkpointing/test_mapping.py"),
    "test_validation": UpstreamFile("lm", "tests/unit_tests/dist_checkpointing/test_validation.py"),
    "test_async_utils_shutdown": UpstreamFile(
        "lm", "tests/unit_tests/dist_checkpointing/test_async_utils_shutdown.py"
    ),
    "test_async_save": UpstreamFile("lm", "tests/unit_tests/dist_checkpointing/test_async_save.py", 8),
    "test_serialization": UpstreamFile("lm", "tests/unit_tests/dist_checkpointing/test_serialization.py", 8),
    "test_param_mapping": UpstreamFile("bridge", "tests/unit_tests/models/test_param_mapping.py"),
    "test_mapping_registry": UpstreamFile("bridge", "tests/unit_tests/models/test_mapping_registry.py"),
    "test_model_bridge": UpstreamFile("bridge", "tests/unit_tests/models/test_model_bridge.py"),
    "test_auto_bridge": UpstreamFile("bridge", "tests/unit_tests/models/test_auto_bridge.py"),
    "test_llama_bridge": UpstreamFile("bridge", "tests/unit_tests/models/llama/test_llama_bridge.py"),
    "test_optimizer": UpstreamFile("lm", "tests/unit_tests/dist_checkpointing/test_optimizer.py", 8),
    "test_gpt_model": UpstreamFile("lm", "tests/unit_tests/dist_checkpointing/models/test_gpt_model.py", 8),
    "test_routers": UpstreamFile("lm", "tests/unit_tests/transformer/moe/test_routers.py", 8),
    "test_moe_layer": UpstreamFile("lm", "tests/unit_tests/transformer/moe/test_moe_layer.py", 8),
    "test_sequential_mlp": UpstreamFile("lm", "tests/unit_tests/transformer/moe/test_sequential_mlp.py", 8),
    "test_module_matcher": UpstreamFile("bridge", "tests/unit_tests/peft/test_module_matcher.py"),
    "test_lora": UpstreamFile("bridge", "tests/unit_tests/peft/test_lora.py"),
    "test_adapter_wrapper": UpstreamFile("bridge", "tests/unit_tests/peft/test_adapter_wrapper.py"),
    "test_walk_utils": UpstreamFile("bridge", "tests/unit_tests/peft/test_walk_utils.py"),
}

SCOPE_DIR = Path(__file__).with_name("upstream_tests_scope")
"""``<name>.json`` per file: test-id prefix -> why it is out of scope (a real GPU, or a feature we lack)."""


def out_of_scope(name: str) -> dict[str, str]:
    path = SCOPE_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


_PREFIXES = [
    (r"\bmegatron\.bridge\.models\b", "megatron_lite.bridge.models"),
    (r"\bmegatron\.bridge\b", "megatron_lite"),
    (r"\bmegatron\.core\b", "megatron_lite.core"),
    (r"\bmegatron\.training\b", "megatron_lite.training"),
]


def read_upstream(root: Path, path: str) -> str:
    """A file from a work tree, or from HEAD of a bare mirror."""
    if (root / path).exists():
        return (root / path).read_text()
    return subprocess.run(
        ["git", "--git-dir", str(root), "show", f"HEAD:{path}"], check=True, capture_output=True, text=True
    ).stdout


def _mentions_cuda(node: ast.AST) -> bool:
    text = ast.unparse(node).lower()
    return "cuda" in text or "gpu" in text


def _is_cuda_skip(decorator: ast.expr) -> bool:
    text = ast.unparse(decorator)
    return ("skipif" in text or "run_only_on" in text) and _mentions_cuda(decorator)


class _Port(ast.NodeTransformer):
    def _strip(self, node):
        node.decorator_list = [d for d in node.decorator_list if not _is_cuda_skip(d)]
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _strip


def _name_by_name(stmt: ast.stmt) -> list[ast.stmt]:
    """``from m import a, b`` -> one guarded import per name; a missing name becomes a stand-in that
    fails the test using it."""
    out = []
    if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.startswith("megatron_lite"):
        for alias in stmt.names:
            bound = alias.asname or alias.name
            out += ast.parse(
                f"try:\n    from {stmt.module} import {alias.name} as {bound}\n"
                f"except ImportError as _e:\n    {bound} = _Missing({stmt.module + '.' + alias.name!r}, _e)\n"
            ).body
        return out
    if isinstance(stmt, ast.Import) and any(a.name.startswith("megatron_lite") for a in stmt.names):
        for alias in stmt.names:
            if alias.asname:
                out += ast.parse(
                    f"try:\n    import {alias.name} as {alias.asname}\n"
                    f"except ImportError as _e:\n    {alias.asname} = _Missing({alias.name!r}, _e)\n"
                ).body
            else:
                out.append(stmt)
        return out
    if (
        isinstance(stmt, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets)
        and _mentions_cuda(stmt.value)
    ):
        return []
    return [stmt]


_MISSING = '''
class _MissingMeta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        cls._fail()


def _Missing(name, error):
    """Stands in for an upstream name megatron_lite lacks: a class, so annotations and subclasses
    still work; any use fails the test that uses it."""

    def _fail(*args, **kwargs):
        raise ImportError(f"megatron_lite lacks {name}: {error}")

    return _MissingMeta(name.rsplit(".", 1)[-1], (), {"__new__": _fail, "_fail": staticmethod(_fail)})
'''


def port_source(source: str) -> str:
    for pattern, replacement in _PREFIXES:
        source = re.sub(pattern, replacement, source)
    tree = _Port().visit(ast.parse(source))
    body = []
    for stmt in tree.body:
        body += _name_by_name(stmt)
    future = [s for s in body if isinstance(s, ast.ImportFrom) and s.module == "__future__"]
    rest = [s for s in body if s not in future]
    tree.body = future + ast.parse(_MISSING).body + rest
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


_CONFTEST = """
import json, os
import pytest
import torch

# CPU run: .cuda() keeps tensors and modules where they are (tests that need a real GPU are listed
# out of scope in tools/port_upstream_tests.py).
torch.Tensor.cuda = lambda self, *a, **k: self
torch.nn.Module.cuda = lambda self, *a, **k: self
torch.cuda.set_device = lambda *a, **k: None
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"  # device=torch.cuda.current_device() makes a CPU tensor


# Likewise device="cuda" in a tensor factory (a fixture's loss tensor, say) makes the tensor here.
def _here(factory):
    def make(*args, **kwargs):
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


for _name in ("tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange"):
    setattr(torch, _name, _here(getattr(torch, _name)))

_RESULTS = {}


def _out_of_scope(nodeid, scope):
    test = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid
    return any(test == p or test.startswith(p + "[") or test.startswith(p + "::") for p in scope)


def pytest_collection_modifyitems(config, items):
    # Out-of-scope tests are not run (a world of 8 ranks spends most of its time on them); they are
    # recorded as such so that the count still names them.
    scope = json.loads(os.environ.get("PORT_SCOPE", "{}"))
    out = [item for item in items if _out_of_scope(item.nodeid, scope)]
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [item for item in items if item not in out]
        _RESULTS.update({item.nodeid: "out of scope" for item in out})


def pytest_configure(config):
    for mark in ("internal", "flaky", "flaky_in_dev", "run_only_on", "experimental", "asyncio"):
        config.addinivalue_line("markers", mark)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        previous = _RESULTS.get(report.nodeid)
        if previous in ("failed", "error"):
            return
        outcome = report.outcome if report.when == "call" else ("error" if report.failed else report.outcome)
        _RESULTS[report.nodeid] = outcome
        _dump()


def _dump():
    # After every test, so a world ended by its timeout still reports the tests that ran.
    out = os.environ.get("PORT_RESULTS")
    if out:
        with open(f"{out}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
            json.dump(_RESULTS, f)


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt():
    # One directory for every rank of the world (each rank's pytest has its own tmp_path).
    from pathlib import Path

    path = Path(os.environ.get("PORT_RESULTS", "/tmp/ported")).parent / "tmp_dist_ckpt"
    path.mkdir(parents=True, exist_ok=True)
    yield path


def pytest_sessionfinish(session):
    _dump()
"""

_TEST_UTILITIES = '''
"""megatron_lite's own CPU stand-in for Megatron-LM's tests/unit_tests/test_utilities.py: a gloo world
from torchrun's environment, model parallelism through megatron_lite.core.parallel_state."""
import datetime
import os
import torch
import torch.distributed

import megatron_lite.core.parallel_state as ps


class TestModel(torch.nn.Module):
    def __init__(self, input_dim, output_dim, num_layers, bias, shared_embedding=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(input_dim, output_dim, bias) for _ in range(num_layers)]
        )
        if shared_embedding:
            self.layers[-1].weight.shared_embedding = True


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    inited = False

    @staticmethod
    def initialize_distributed():
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            # A short timeout: a rank that failed a test and left a collective ends the others' wait
            # (their test fails) instead of hanging the world.
            torch.distributed.init_process_group(
                backend="gloo",
                world_size=Utils.world_size,
                rank=Utils.rank,
                init_method="env://",
                timeout=datetime.timedelta(seconds=int(os.environ.get("PORT_PG_TIMEOUT_S", "120"))),
            )
            torch.distributed.barrier()
        Utils.inited = True

    @staticmethod
    def set_world_size(world_size=None, rank=None):
        Utils.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        if torch.distributed.is_initialized() and Utils.world_size != torch.distributed.get_world_size():
            torch.distributed.destroy_process_group()
        if rank is None:
            Utils.rank = int(os.environ.get("RANK", "0"))
            if Utils.rank >= Utils.world_size:
                Utils.rank = -1
        else:
            Utils.rank = rank

    @staticmethod
    def destroy_model_parallel():
        if not Utils.inited:
            return
        torch.distributed.barrier()
        ps.destroy_model_parallel()
        Utils.inited = False

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ):
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        Utils.inited = True
'''


_DIST_CKPT_INIT = '''
"""megatron_lite's stand-in for Megatron-LM's tests/unit_tests/dist_checkpointing/__init__.py: a named
temporary directory that every rank of the world shares (rank 0 makes it empty and removes it)."""
import os
import shutil
from pathlib import Path

import torch

from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.dist_checkpointing.utils import (  # noqa: F401 (upstream's helpers, ported)
    init_basic_mock_args,
    init_checkpointing_mock_args,
    initialize_gpt_model,
    setup_model_and_optimizer,
    setup_moe_model_and_optimizer,
)


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class TempNamedDir:
    def __init__(self, name, sync=True, ignore_cleanup_errors=False):
        self.name, self.sync = str(name), sync
        if Utils.rank <= 0:
            shutil.rmtree(self.name, ignore_errors=True)
            os.makedirs(self.name, exist_ok=True)
        if sync:
            _barrier()
        else:
            os.makedirs(self.name, exist_ok=True)

    def cleanup(self, override_sync=None):
        if self.sync if override_sync is None else override_sync:
            _barrier()
        if Utils.rank <= 0:
            shutil.rmtree(self.name, ignore_errors=True)

    def __enter__(self):
        if self.sync:
            _barrier()
        return Path(self.name)

    def __exit__(self, exc_type, exc_val, exc_tb):
        if exc_type is None:
            self.cleanup()
'''


def _selected(nodeid: str, out_of_scope: dict[str, str]) -> str | None:
    test = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid
    for prefix, reason in out_of_scope.items():
        if test == prefix or test.startswith(prefix + "[") or test.startswith(prefix + "::"):
            return reason
    return None


def _run_world(cmd: list[str], cwd: Path, env: dict, timeout_s: int) -> tuple[int | None, str]:
    """Runs one file's pytest (a whole torchrun world) in a session of its own; past ``timeout_s`` the
    session is killed, every rank with it, and the exit status is None."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, log
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        return None, log + f"\n[port] killed after {timeout_s} s\n"
    except BaseException:  # interrupted or terminated ourselves: the world in its own session goes too
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def _port_helpers(spec: UpstreamFile, root: Path, work: Path) -> None:
    """Upstream's shared test helpers that a file imports, ported as the file is (the ``__init__`` and
    ``test_utilities`` stand-ins above excepted)."""
    if "/dist_checkpointing/" not in spec.path:
        return
    base = work / "tests" / "unit_tests" / "dist_checkpointing"
    (base / "models").mkdir(parents=True, exist_ok=True)
    (base / "models" / "__init__.py").write_text("")
    for rel in ("utils.py", "models/common.py"):
        upstream = read_upstream(root, f"tests/unit_tests/dist_checkpointing/{rel}")
        (base / rel).write_text(port_source(upstream))


def run_file(
    name: str, spec: UpstreamFile, roots: dict[str, Path], out: Path, verbose: bool, timeout_s: int = 1800
) -> dict:
    work = out / name
    (work / "tests" / "unit_tests").mkdir(parents=True, exist_ok=True)
    for pkg in (work / "tests", work / "tests" / "unit_tests"):
        (pkg / "__init__.py").write_text("")
    (work / "tests" / "unit_tests" / "test_utilities.py").write_text(_TEST_UTILITIES)
    if "/dist_checkpointing/" in spec.path:  # upstream's tests import its TempNamedDir from there
        (work / "tests" / "unit_tests" / "dist_checkpointing").mkdir(exist_ok=True)
        (work / "tests" / "unit_tests" / "dist_checkpointing" / "__init__.py").write_text(_DIST_CKPT_INIT)
        _port_helpers(spec, roots[spec.repo], work)
    (work / "conftest.py").write_text(_CONFTEST)
    target = work / "tests" / "unit_tests" / f"{name}.py"
    target.write_text(port_source(read_upstream(roots[spec.repo], spec.path)))

    results = work / "results"
    for old in work.glob("results.rank*.json"):
        old.unlink()
    env = dict(os.environ, PORT_RESULTS=str(results), PYTHONPATH=str(work))
    env["PORT_SCOPE"] = json.dumps(out_of_scope(name))
    env.setdefault("OMP_NUM_THREADS", "1")
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(target)]
    pytest_args += ["--rootdir", str(work), "-o", "addopts=", "-W", "ignore"]
    if spec.world_size > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={spec.world_size}", "--tee=0", "--redirects=0"]
        cmd += ["--no-python", sys.executable, *pytest_args]
        # torchrun's own output would be 8 copies; keep rank 0's.
        cmd = [sys.executable, "-c", _RANK0_ONLY, *cmd]
    else:
        cmd = [sys.executable, *pytest_args]
    returncode, log = _run_world(cmd, work, env, timeout_s)
    (work / "pytest.log").write_text(log)

    per_rank = [json.loads(p.read_text()) for p in sorted(work.glob("results.rank*.json"))]
    if returncode is None:
        print(f"{name}: the world was ended after {timeout_s} s; counting the tests that finished")
    if not per_rank:
        print(f"{name}: no results (exit {returncode}); see {work / 'pytest.log'}")
        print("\n".join(log.splitlines()[-15:]))
        return {"name": name, "in_scope": 0, "passed": 0, "out_of_scope": 0, "failed": []}
    outcomes: dict[str, str] = {}
    for ranks in per_rank:
        for nodeid, outcome in ranks.items():
            if outcomes.get(nodeid) in (None, "passed", "skipped"):
                outcomes[nodeid] = outcome if outcomes.get(nodeid) != "skipped" else outcomes[nodeid]
    scope = out_of_scope(name)
    in_scope = {n: o for n, o in outcomes.items() if _selected(n, scope) is None}
    skipped_out = len(outcomes) - len(in_scope)
    passed = [n for n, o in in_scope.items() if o == "passed"]
    failed = [n for n, o in in_scope.items() if o != "passed"]
    line = f"{name}: {len(passed)}/{len(in_scope)} in-scope tests pass ({skipped_out} out of scope)"
    print(line, flush=True)
    if verbose:
        for n in failed:
            print(f"    {in_scope[n]:7s} {n.split('::', 1)[1]}")
    return {
        "name": name,
        "in_scope": len(in_scope),
        "passed": len(passed),
        "out_of_scope": skipped_out,
        "failed": failed,
    }


_RANK0_ONLY = r"""
import os, subprocess, sys
# torchrun: every rank's pytest prints; show the summary of rank 0 only.
os.environ["PYTHONUNBUFFERED"] = "1"
sys.exit(subprocess.call(sys.argv[1:]))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True, help="Megatron-LM work tree or git dir")
    parser.add_argument("--megatron-bridge", type=Path, required=True, help="Megatron-Bridge tree or git dir")
    parser.add_argument("--only", nargs="*", default=None, choices=sorted(FILES), metavar="NAME")
    parser.add_argument("--out", type=Path, default=None, help="where the ported copies go")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one file's world may run")
    parser.add_argument("-v", "--verbose", action="store_true", help="list the failing in-scope tests")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so a running world is killed
    roots = {"lm": args.megatron_lm, "bridge": args.megatron_bridge}
    out = args.out or Path(tempfile.mkdtemp(prefix="ported_upstream_tests_"))
    names = args.only or FILES
    summary = [run_file(n, FILES[n], roots, out, args.verbose, args.timeout) for n in names]
    total = sum(s["in_scope"] for s in summary)
    passed = sum(s["passed"] for s in summary)
    print(f"total: {passed}/{total} in-scope upstream tests pass ({100 * passed / max(total, 1):.1f}%)")
    print(f"ported copies and logs: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
