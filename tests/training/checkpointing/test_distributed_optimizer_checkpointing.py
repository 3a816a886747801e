"""Distributed-optimizer checkpoints: upstream's legacy layout, exact resume, re-sharding, faults."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch
from checkpoint_helpers import BASE, refused
from dist_helpers import loss_lines, ok, parse_losses, run_pretrain
from job_helpers import Job, alive, children, rank_of

pytestmark = pytest.mark.world  # every test here starts processes

SHARDED = [
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--ddp-bucket-size",
    "6000",
]
PP2_DP2 = ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "4", *SHARDED]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """12 iterations straight, and 6 iterations + save; pp = 2, dp = 2, distributed optimizer."""
    root = tmp_path_factory.mktemp("dist_ckpt")
    straight = ok(run_pretrain([*BASE, *PP2_DP2], root))
    ok(run_pretrain([*BASE, *PP2_DP2, "--save", "ckpt", "--exit-interval", "6"], root))
    return root, straight


def test_optimizer_shards_sit_beside_the_model_shards(saved):
    root, _ = saved
    it = root / "ckpt" / "iter_0000006"
    for shard in ("mp_rank_00_000", "mp_rank_00_001"):
        state = torch.load(it / shard / "distrib_optim.pt", weights_only=False)
        assert state["buckets_coalesced"] is True
        world = state[0]["torch.float32"]
        assert set(world) == {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"}
        # Padding stripped: one fp32 value per parameter of the stage, whatever the dp size.
        model = torch.load(it / shard / "model_optim_rng.pt", weights_only=False)["model"]
        assert world["param"].numel() == world["numel_unpadded"] == sum(t.numel() for t in model.values())
        assert world["exp_avg_sq"].min() >= 0 and world["exp_avg_sq"].max() > 0


def test_resume_is_bitwise_identical(saved, tmp_path):
    root, straight = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    resumed = ok(run_pretrain([*BASE, *PP2_DP2, "--load", "ckpt"], tmp_path))
    assert "successfully loaded checkpoint" in resumed.stdout
    want, got = loss_lines(straight.stdout), loss_lines(resumed.stdout)
    assert sorted(got) == list(range(7, 13))
    assert {it: want[it] for it in range(7, 13)} == got


def test_another_data_parallel_size_reshards(saved, tmp_path):
    root, straight = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    dp1 = ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "2", *SHARDED]
    resumed = ok(run_pretrain([*BASE, *dp1, "--load", "ckpt"], tmp_path))
    want, got = parse_losses(straight.stdout), parse_losses(resumed.stdout)
    assert sorted(got) == list(range(7, 13))
    for it in range(7, 13):  # the same state; only the reduction order differs
        assert abs(got[it] - want[it]) <= 5e-4 * want[it], (it, got[it], want[it])


def test_missing_optimizer_shard_isrefused(saved, tmp_path):
    root, _ = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    os.remove(tmp_path / "ckpt" / "iter_0000006" / "mp_rank_00_001" / "distrib_optim.pt")
    refused(tmp_path, PP2_DP2, "no optimizer shard iter_0000006/mp_rank_00_001/distrib_optim.pt")


def test_loading_without_the_distributed_optimizer_isrefused(saved, tmp_path):
    root, _ = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    plain = ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "4"]
    refused(tmp_path, plain, "was saved with --use-distributed-optimizer but this run is without it")


def test_killing_a_worker_mid_save_keeps_the_previous_checkpoint(tmp_path):
    common = [*BASE[:-4], *PP2_DP2, "--save", "ckpt"]  # BASE without its --train-iters / --log-interval
    env_backup = os.environ.get("MEGATRON_LITE_TEST_SAVE_DELAY_S")
    os.environ["MEGATRON_LITE_TEST_SAVE_DELAY_S"] = "2"
    try:
        job = Job([*common, "--train-iters", "1000", "--save-interval", "2"], tmp_path)
        job.wait_for("successfully saved checkpoint from iteration       2")
        pending = tmp_path / "ckpt" / ".tmp_iter_0000004" / "mp_rank_00_001" / "distrib_optim.pt"
        deadline = time.monotonic() + 60
        while not pending.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        workers = children(job.proc.pid)
        os.kill(next(pid for pid in workers if rank_of(pid) == 0), signal.SIGKILL)
        assert job.proc.wait(timeout=60) != 0
        assert not any(alive(pid) for pid in workers)
    finally:
        if env_backup is None:
            os.environ.pop("MEGATRON_LITE_TEST_SAVE_DELAY_S")
        else:
            os.environ["MEGATRON_LITE_TEST_SAVE_DELAY_S"] = env_backup
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # A shorter run than the killed one: another schedule, which resuming refuses unless overridden.
    resumed = ok(
        run_pretrain(
            [*common, "--train-iters", "3", "--load", "ckpt", "--override-opt-param-scheduler"], tmp_path
        )
    )
    assert "successfully loaded checkpoint from ckpt at iteration 2" in resumed.stdout
    assert sorted(parse_losses(resumed.stdout)) == [3]
