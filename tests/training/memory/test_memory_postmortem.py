"""A rank that runs out of memory leaves a post-mortem and the job ends naming its stage; CUDA memory
history as upstream (mocked: no GPU here), refused without CUDA."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
from dist_helpers import REPO, run_pretrain

from megatron_lite.training.memory import snapshots as memory_history
from megatron_lite.training.memory.postmortem import is_out_of_memory

PP = 4
MODEL = (
    f"--pipeline-model-parallel-size {PP} --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 32 --max-position-embeddings 32 --vocab-size 128 --micro-batch-size 2 --global-batch-size 8 "
    "--train-iters 4 --log-interval 1"
).split()

# A job whose stage-1 rank makes a real allocation the CPU allocator cannot satisfy, in its 6th
# microbatch (iteration 2: four microbatches per iteration).
DRIVER = """
import os, sys
sys.path.insert(0, {repo!r})
import torch
import pretrain as entry
from megatron_lite.training import gpt_step

real, calls = gpt_step.forward_step, [0]

def forward_step(state, data_iterator, model, return_schedule_plan=False):
    calls[0] += 1
    if os.environ["RANK"] == "1" and calls[0] == 6:
        torch.empty(2**50, dtype=torch.uint8)  # a petabyte
    return real(state, data_iterator, model, return_schedule_plan)

gpt_step.forward_step = forward_step
if "RANK" in os.environ:
    entry.exit_worker(entry.worker_main(sys.argv[1:]))
from megatron_lite.training.launcher import launch
sys.exit(launch([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], {pp}))
"""


@pytest.mark.world
def test_an_out_of_memory_rank_names_its_stage_and_leaves_a_post_mortem(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO), pp=PP))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, str(driver), *MODEL, "--tensorboard-dir", "tb", "--log-memory-to-tensorboard"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    path = tmp_path / "tb" / "oom-rank1.json"
    errors = [line for line in result.stderr.splitlines() if line.startswith("pretrain.py: error:")]
    assert errors == [
        f"pretrain.py: error: rank 1 (pipeline stage 1) ran out of memory at iteration 2: RuntimeError: "
        f"{json.loads(path.read_text())['error'].split(': ', 1)[1]}; post-mortem: tb/oom-rank1.json"
    ], result.stderr
    assert "Traceback" not in result.stderr
    record = json.loads(path.read_text())
    assert (record["rank"], record["pipeline_stage"], record["iteration"]) == (1, 1, 2)
    assert "can't allocate memory" in record["error"]
    memory = record["memory_gigabytes"]
    for name in ("weights", "grads", "optimizer-state", "activation", "other", "rss"):
        assert memory[f"mem-{name}-gigabytes"] >= 0, name
    assert memory["mem-activation-gigabytes"] > 0  # it died mid-step, with microbatches in flight
    prediction = record["prediction_bytes"]  # its stage's, labelled, beside the measurement
    assert prediction["label"] == "prediction" and prediction["pp_rank"] == 1
    assert prediction["weights_bytes"] == pytest.approx(memory["mem-weights-gigabytes"] * 1e9, rel=1e-3)
    assert not [p for p in os.listdir(tmp_path / "tb") if ".tmp" in p]  # written atomically
    assert list((tmp_path / "tb").glob("oom-rank*.json")) == [path]  # only the rank that ran out


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."))
    import torch

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


@pytest.mark.world
def test_memory_history_is_refused_without_cuda(tmp_path):
    result = run_pretrain([*MODEL, "--record-memory-history"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pretrain.py: error: --record-memory-history: records the CUDA caching allocator's history, which "
        "needs CUDA; this machine has no GPU (on CPU the memory/* dashboards and the OOM post-mortem still "
        "explain memory)"
    ]
    assert os.listdir(tmp_path) == []
    result = run_pretrain([*MODEL, "--memory-snapshot-path", "s.pickle"], tmp_path)
    assert result.returncode == 2 and "needs --record-memory-history" in result.stderr


def test_memory_history_records_and_snapshots_as_upstream(mocker, tmp_path):
    """On CUDA (mocked): the flags reach the config, recording starts with upstream's entry budget, and
    a snapshot is written atomically where asked; an OOM's goes beside it, upstream's name."""
    from megatron_lite.training.arguments import parse_args

    mocker.patch("torch.cuda.is_available", return_value=True)
    snapshot_path = str(tmp_path / "mem" / "snap.pickle")
    config = parse_args([*MODEL, "--record-memory-history", "--memory-snapshot-path", snapshot_path])
    assert config.profiling.record_memory_history and config.profiling.memory_snapshot_path == snapshot_path
    assert not config.profiling.use_nsys_profiler and not config.profiling.use_pytorch_profiler
    record = mocker.patch("torch.cuda.memory._record_memory_history")
    mocker.patch("torch.cuda.memory._snapshot", return_value={"segments": [1, 2], "device_traces": []})
    memory_history.start_memory_history()
    record.assert_called_once_with(max_entries=100_000)
    assert memory_history.dump_memory_snapshot(snapshot_path) == snapshot_path
    with open(snapshot_path, "rb") as f:
        assert pickle.load(f) == {"segments": [1, 2], "device_traces": []}
    assert memory_history.oom_snapshot_path(snapshot_path, 3) == str(
        tmp_path / "mem" / "oom_rank-3_snap.pickle"
    )
    assert os.listdir(tmp_path / "mem") == ["snap.pickle"]


def test_memory_history_needs_no_profile_and_has_upstreams_default_path(mocker):
    from megatron_lite.training.arguments import parse_args

    mocker.patch("torch.cuda.is_available", return_value=True)
    assert parse_args(MODEL).profiling is None
    assert parse_args([*MODEL, "--record-memory-history"]).profiling.memory_snapshot_path == "snapshot.pickle"
