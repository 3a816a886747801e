"""Loading a checkpoint can never run code: weights_only with an allowlist of what megatron_lite writes.

Each payload below would create a marker file if unpickled with ``weights_only=False``; the load
must refuse it with one line naming the file and the type, leave the directory byte-for-byte as it
was, and never run it. Checkpoints of the older layout (NumPy RNG state, the config's callables)
still load and resume exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickletools
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import tree_digest
from dist_helpers import SMALL_MODEL, loss_lines, ok, run_pretrain

from megatron_lite.core.utils import init_method_normal
from megatron_lite.training.arguments import parse_args
from megatron_lite.training.checkpointing.safety import load_checkpoint_file, plain

ROOT = Path(__file__).resolve().parents[3]
ITERS = [*SMALL_MODEL, "--train-iters", "4", "--log-interval", "1"]
DIST_OPT = ["--nproc-per-node", "2", "--use-distributed-optimizer", "--micro-batch-size", "1"]


class _CreatesFile:
    """Unpickled without weights_only, this runs ``os.system('touch MARKER')``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _only_torch_globals(path) -> bool:
    """Whether the file's pickle names nothing but torch's own types and OrderedDict: read from its
    opcodes, not from torch's allowlist, which other imports (megatron-core) widen process-wide."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    names = {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(data) if "GLOBAL" in op.name}
    return bool(names) and all(n.startswith("torch.") or n == "collections.OrderedDict" for n in names)


def _trusted_load(path: Path):
    return torch.load(path, weights_only=False)  # the test's own file, to rewrite it


def _plant(path: Path, marker: Path) -> None:
    payload = _trusted_load(path)
    payload["extra"] = _CreatesFile(marker)
    torch.save(payload, path)


def refused(tmp_path: Path, argv: list[str], shard: str, marker: Path) -> None:
    before = tree_digest(tmp_path / "ckpt")
    result = run_pretrain([*argv, "--load", "ckpt", "--save", "ckpt"], tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"refusing {shard}" in lines[0] and "posix.system" in lines[0], lines[0]
    assert "iteration " not in result.stdout
    assert not marker.exists(), "the payload ran"
    assert tree_digest(tmp_path / "ckpt") == before


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Four iterations saved at 2 and 4: the straight run's losses, and its directory."""
    root = tmp_path_factory.mktemp("saved")
    straight = ok(run_pretrain([*ITERS, "--save", "ckpt", "--save-interval", "2"], root))
    return root / "ckpt", straight


def _at_iteration_2(saved, tmp_path: Path) -> None:
    """A copy of the saved directory whose tracker names iteration 2 (as a run stopped there left it)."""
    shutil.copytree(saved[0], tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000004")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2\n")


@pytest.mark.world
def test_a_code_payload_in_model_optim_rng_isrefused(saved, tmp_path):
    _at_iteration_2(saved, tmp_path)
    path = tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    # What megatron_lite writes needs nothing beyond torch's own weights-only allowlist.
    assert _only_torch_globals(path)
    marker = tmp_path / "PWNED"
    _plant(path, marker)
    refused(tmp_path, ITERS, "iter_0000002/mp_rank_00/model_optim_rng.pt", marker)


@pytest.mark.world
def test_a_code_payload_in_distrib_optim_isrefused(tmp_path):
    ok(run_pretrain([*ITERS, *DIST_OPT, "--save", "ckpt", "--exit-interval", "2"], tmp_path))
    shard = tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00"
    for name in ("model_optim_rng.pt", "distrib_optim.pt"):
        assert _only_torch_globals(shard / name)
    marker = tmp_path / "PWNED"
    _plant(shard / "distrib_optim.pt", marker)
    refused(tmp_path, [*ITERS, *DIST_OPT], "iter_0000002/mp_rank_00/distrib_optim.pt", marker)


def _as_older_layout(path: Path) -> None:
    """Rewrite a shard as megatron_lite wrote it before checkpoints were plain: NumPy's RNG state as
    an ndarray, and the config's activation and init methods as the callables themselves."""
    payload = _trusted_load(path)
    name, key, *rest = payload["rng_state"]["numpy"]
    payload["rng_state"]["numpy"] = (name, key.numpy().astype(np.uint32), *rest)
    model = payload["config"]["model"]
    model["activation_func"] = F.gelu
    model["init_method"] = init_method_normal(0.02)
    model["output_layer_init_method"] = functools.partial(init_method_normal(0.02).func, sigma=0.01)
    torch.save(payload, path)
    # (Not get_unsafe_globals_in_checkpoint: megatron-core, imported by other tests in this process,
    # adds NumPy to torch's process-wide allowlist.)
    assert isinstance(_trusted_load(path)["rng_state"]["numpy"][1], np.ndarray)


@pytest.mark.world
def test_a_checkpoint_of_the_older_layout_loads_and_resumes_exactly(saved, tmp_path):
    straight = saved[1]
    _at_iteration_2(saved, tmp_path)
    _as_older_layout(tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    resumed = ok(run_pretrain([*ITERS, "--load", "ckpt"], tmp_path))
    assert "successfully loaded checkpoint" in resumed.stdout
    assert {it: loss_lines(straight.stdout)[it] for it in (3, 4)} == loss_lines(resumed.stdout)


# Flags that put objects (not numbers or strings) into the config that older checkpoints pickled whole.
OLDER_CONFIGS = [
    [],
    "--swiglu --normalization RMSNorm --position-embedding-type rope --bf16".split(),
    ["--squared-relu"],
    "--pipeline-model-parallel-size 2 --num-layers 4 --pipeline-model-parallel-layout Ett|ttL".split(),
    "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2".split(),
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split(),
    "--profile --use-pytorch-profiler".split(),
]


@pytest.mark.parametrize("argv", OLDER_CONFIGS, ids=lambda a: " ".join(a[:2]) or "default")
def test_an_older_config_needs_the_legacy_allowlist_only_and_a_current_one_nothing(argv, tmp_path):
    cfg = parse_args(argv)
    older, current = tmp_path / "older.pt", tmp_path / "current.pt"
    torch.save({"model": {}, "config": dataclasses.asdict(cfg)}, older)  # as checkpoints were written
    torch.save({"model": {}, "config": plain(cfg)}, current)
    assert _only_torch_globals(current)
    loaded = load_checkpoint_file(str(older), str(tmp_path))  # refused if any type is missing
    assert loaded["config"]["model"]["num_layers"] == cfg.model.num_layers


def test_every_reader_of_a_file_is_weights_only():
    """No unpickling outside checkpointing.safety (and the torch_dist reader's restricted unpickler of
    DCP's .metadata, tests/test_dist_checkpointing.py; and core's weights-only reader, which cannot
    import training): a new torch.load, pickle.load or allow_pickle=True anywhere in the package fails
    here."""
    core_reader = ROOT / "megatron_lite/core/dist_checkpointing/strategies/common.py"
    assert re.findall(r"\btorch\.load\([^)]*\)", core_reader.read_text()) == [
        'torch.load(source, map_location="cpu", weights_only=True)'
    ]
    offenders = []
    for path in sorted((ROOT / "megatron_lite").rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        if path == core_reader:
            text = text.replace('torch.load(source, map_location="cpu", weights_only=True)', "")
        for pattern in (
            r"\btorch\.load\(",
            r"\bpickle\.loads?\(",
            r"allow_pickle\s*=\s*True",
            r"\bweights_only\s*=\s*False",
        ):
            for match in re.finditer(pattern, text):
                if not (rel.endswith("training/checkpointing/safety.py") and "torch.load" in match.group(0)):
                    offenders.append(f"{rel}: {match.group(0)}")
    assert offenders == []
