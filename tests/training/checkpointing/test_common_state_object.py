"""A ``torch_dist`` checkpoint of Megatron-LM's HEAD keeps its common state as one megatron-core
ShardedObject (``common_state``) inside the DCP files instead of ``common.pt``: read as raw bytes and
unpickled with the same allowlist as ``common.pt`` (DCP's own load would unpickle it with
``weights_only=False``); a payload in it never runs, a cut file is one line. (The readable case, a
whole resume, is in test_megatron_lm_optimizer_layouts.py.)"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_lite.training.checkpointing.layout import COMMON_STATE_OBJECT, read_common
from megatron_lite.training.checkpointing.safety import CheckpointError


class _CreatesFile:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _checkpoint(root: Path, common) -> Path:
    """Iteration 1 of ``root`` with ``common`` stored as a ShardedObject under its unique key: an
    ``io.BytesIO`` of ``torch.save([common])``, which DCP's own planner pickles (megatron-core's stores
    the bytes as they are: the world test's case)."""
    data = io.BytesIO()
    torch.save([common], data)
    data.seek(0)
    directory = root / "iter_0000001"
    dcp.save({COMMON_STATE_OBJECT: data, "w": torch.ones(2)}, checkpoint_id=str(directory), no_dist=True)
    return directory


def test_a_payload_in_the_common_state_object_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "PWNED"
    _checkpoint(tmp_path / "ckpt", {"iteration": 1, "extra": _CreatesFile(marker)})
    with pytest.raises(CheckpointError) as err:
        read_common(str(tmp_path / "ckpt"), 1)
    assert f"refusing iter_0000001/{COMMON_STATE_OBJECT}: it holds posix.system" in str(err.value)
    assert not marker.exists(), "the payload ran"


def test_a_cut_data_file_is_one_line(tmp_path):
    directory = _checkpoint(tmp_path / "ckpt", {"iteration": 1})
    (data_file,) = directory.glob("*.distcp")
    data_file.write_bytes(data_file.read_bytes()[:10])
    with pytest.raises(CheckpointError) as err:
        read_common(str(tmp_path / "ckpt"), 1)
    assert str(err.value).startswith(f"--load {tmp_path / 'ckpt'}: iteration 1: cannot read its common state")
    assert "cut short" in str(err.value)


def test_without_common_pt_or_the_object_the_iteration_is_incomplete(tmp_path):
    directory = tmp_path / "ckpt" / "iter_0000001"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(directory), no_dist=True)
    with pytest.raises(CheckpointError, match="iteration 1 is incomplete \\(no common.pt\\)"):
        read_common(str(tmp_path / "ckpt"), 1)
