"""Checkpoints: exact resume, Megatron layout, atomic writes, refusal of bad checkpoints, faults."""

from __future__ import annotations

import os
import signal
import time

import pytest
from checkpoint_helpers import BASE, refused
from dist_helpers import SMALL_MODEL, loss_lines, ok, parse_losses, run_pretrain
from job_helpers import Job, alive, children, rank_of
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.world  # every test here starts processes

PP2_DP2 = ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "4"]


def tb_steps(logdir, tag="lm loss") -> list[int]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def saved_pp2_dp2(tmp_path_factory):
    """12 iterations straight, and 6 iterations + save; both with pp = 2, dp = 2."""
    root = tmp_path_factory.mktemp("ckpt")
    straight = ok(run_pretrain([*BASE, *PP2_DP2], root))
    first = ok(
        run_pretrain(
            [*BASE, *PP2_DP2, "--save", "ckpt", "--exit-interval", "6", "--tensorboard-dir", "tb"], root
        )
    )
    return root, straight, first


def test_megatron_layout_on_disk(saved_pp2_dp2):
    root, _, first = saved_pp2_dp2
    ckpt = root / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    shards = sorted(p.name for p in (ckpt / "iter_0000006").iterdir() if p.is_dir())
    assert shards == ["mp_rank_00_000", "mp_rank_00_001"]  # one per (tp, pp) rank, from dp rank 0
    assert '"pipeline_model_parallel_size": 2' in (ckpt / "iter_0000006" / "metadata.json").read_text()
    assert all((ckpt / "iter_0000006" / s / "model_optim_rng.pt").stat().st_size > 0 for s in shards)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp")]
    import torch

    payload = torch.load(ckpt / "iter_0000006" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert {"model", "optimizer", "opt_param_scheduler", "train_state", "rng_state", "config"} <= set(payload)
    train_state = payload["train_state"]  # upstream's TrainState.state_dict(): 0-d tensors
    assert train_state["step"].dtype == torch.int64 and train_state["step"].item() == 6
    assert train_state["consumed_train_samples"].item() == 48
    assert train_state["floating_point_operations_so_far"].dtype == torch.float64
    assert {"random", "torch", "numpy"} <= set(payload["rng_state"])
    assert payload["config"]["model"]["pipeline_model_parallel_size"] == 2
    assert sorted(parse_losses(first.stdout)) == list(range(1, 7))


def test_resume_is_bitwise_identical(saved_pp2_dp2):
    root, straight, _ = saved_pp2_dp2
    resumed = ok(
        run_pretrain([*BASE, *PP2_DP2, "--load", "ckpt", "--save", "ckpt", "--tensorboard-dir", "tb"], root)
    )
    assert "successfully loaded checkpoint" in resumed.stdout
    want, got = loss_lines(straight.stdout), loss_lines(resumed.stdout)
    assert sorted(got) == list(range(7, 13))
    assert {it: want[it] for it in range(7, 13)} == got
    # TensorBoard continues at the right step: each of 1..12 exactly once across both runs.
    assert tb_steps(root / "tb") == list(range(1, 13))
    assert (root / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "12"


def test_single_stage_resume_is_bitwise_identical(tmp_path):
    straight = ok(run_pretrain(BASE, tmp_path))
    ok(run_pretrain([*BASE, "--save", "c", "--save-interval", "3", "--exit-interval", "6"], tmp_path))
    resumed = ok(run_pretrain([*BASE, "--load", "c", "--save", "c"], tmp_path))
    assert {it: loss_lines(straight.stdout)[it] for it in range(7, 13)} == loss_lines(resumed.stdout)


def test_missing_or_empty_load_dir_starts_fresh(tmp_path):
    (tmp_path / "empty").mkdir()
    for load in ("missing", "empty"):
        result = ok(
            run_pretrain([*SMALL_MODEL, "--train-iters", "2", "--load", load, "--save", load], tmp_path)
        )
        assert "no checkpoint found" in result.stdout and result.stdout.count("no checkpoint found") == 1
        assert sorted(parse_losses(result.stdout)) == [1, 2]


@pytest.fixture
def saved_pp2(tmp_path):
    ok(
        run_pretrain(
            [*SMALL_MODEL, "--train-iters", "2", "--pipeline-model-parallel-size", "2", "--save", "ckpt"],
            tmp_path,
        )
    )
    return tmp_path


def test_other_layout_is_refused_naming_both(saved_pp2):
    line = refused(saved_pp2, ["--pipeline-model-parallel-size", "1"], "saved with tp=1, pp=2")
    assert "this run uses tp=1, pp=1" in line
    line = refused(
        saved_pp2,
        ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
        "saved with tp=1, pp=2",
    )
    assert "tp=2, pp=2" in line


def test_garbage_tracker_isrefused(saved_pp2):
    (saved_pp2 / "ckpt" / "latest_checkpointed_iteration.txt").write_text("not-a-number\x00\n")
    refused(saved_pp2, ["--pipeline-model-parallel-size", "2"], "latest_checkpointed_iteration.txt")


def test_missing_shard_isrefused(saved_pp2):
    import shutil

    shutil.rmtree(saved_pp2 / "ckpt" / "iter_0000002" / "mp_rank_00_001")
    refused(
        saved_pp2,
        ["--pipeline-model-parallel-size", "2"],
        "no shard iter_0000002/mp_rank_00_001/model_optim_rng.pt",
    )


def test_truncated_shard_isrefused(saved_pp2):
    path = saved_pp2 / "ckpt" / "iter_0000002" / "mp_rank_00_000" / "model_optim_rng.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    refused(saved_pp2, ["--pipeline-model-parallel-size", "2"], "corrupt or truncated")


def test_killing_a_worker_mid_save_keeps_the_previous_checkpoint(tmp_path):
    common = [
        *SMALL_MODEL,
        "--pipeline-model-parallel-size",
        "2",
        "--save",
        "ckpt",
        "--tensorboard-dir",
        "tb",
    ]
    args = [*common, "--train-iters", "1000", "--save-interval", "2"]
    env_backup = os.environ.get("MEGATRON_LITE_TEST_SAVE_DELAY_S")
    os.environ["MEGATRON_LITE_TEST_SAVE_DELAY_S"] = "2"
    try:
        job = Job(args, tmp_path)
        job.wait_for("successfully saved checkpoint from iteration       2")
        deadline = time.monotonic() + 60
        while not (tmp_path / "ckpt" / ".tmp_iter_0000004" / "mp_rank_00_001").exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        workers = children(job.proc.pid)
        rank0 = next(pid for pid in workers if rank_of(pid) == 0)
        os.kill(rank0, signal.SIGKILL)  # rank 0 commits the save: kill it in the window
        assert job.proc.wait(timeout=60) != 0
        assert not any(alive(pid) for pid in workers)
    finally:
        if env_backup is None:
            os.environ.pop("MEGATRON_LITE_TEST_SAVE_DELAY_S")
        else:
            os.environ["MEGATRON_LITE_TEST_SAVE_DELAY_S"] = env_backup
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (tmp_path / "ckpt" / "iter_0000004").exists()
    # A shorter run than the killed one: another schedule, which resuming refuses unless overridden.
    resumed = ok(
        run_pretrain(
            [*common, "--train-iters", "5", "--load", "ckpt", "--override-opt-param-scheduler"], tmp_path
        )
    )
    assert "successfully loaded checkpoint from ckpt at iteration 2" in resumed.stdout
    assert sorted(parse_losses(resumed.stdout)) == [3, 4, 5]
    assert tb_steps(tmp_path / "tb") == [1, 2, 3, 4, 5]  # steps 3-4 of the killed run were purged
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".tmp")]


def test_sigterm_with_exit_signal_handler_saves_and_exits_zero(tmp_path):
    job = Job(
        [
            *SMALL_MODEL,
            "--pipeline-model-parallel-size",
            "2",
            "--train-iters",
            "100000",
            "--save",
            "ckpt",
            "--exit-signal-handler",
        ],
        tmp_path,
    )
    job.wait_for("iteration        3/")
    job.proc.send_signal(signal.SIGTERM)
    assert job.proc.wait(timeout=60) == 0, "".join(job.err)
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    last_logged = max(parse_losses("".join(job.out)))
    assert saved == last_logged >= 3
    assert any("exiting program after receiving SIGTERM" in line for line in job.out)


def test_finetune_loads_weights_and_resets_iteration(tmp_path):
    fresh = ok(run_pretrain([*SMALL_MODEL, "--train-iters", "10", "--save", "ckpt"], tmp_path))
    tuned = ok(run_pretrain([*SMALL_MODEL, "--train-iters", "2", "--load", "ckpt", "--finetune"], tmp_path))
    assert sorted(parse_losses(tuned.stdout)) == [1, 2]
    assert parse_losses(tuned.stdout)[1] < parse_losses(fresh.stdout)[1] - 0.05


def test_no_load_optim_resumes_iteration_with_fresh_optimizer(tmp_path):
    ok(run_pretrain([*SMALL_MODEL, "--train-iters", "8", "--save", "c", "--exit-interval", "4"], tmp_path))
    with_optim = ok(run_pretrain([*SMALL_MODEL, "--train-iters", "8", "--load", "c"], tmp_path))
    without = ok(
        run_pretrain([*SMALL_MODEL, "--train-iters", "8", "--load", "c", "--no-load-optim"], tmp_path)
    )
    assert sorted(parse_losses(without.stdout)) == [5, 6, 7, 8]
    assert loss_lines(with_optim.stdout)[5] == loss_lines(without.stdout)[5]  # same weights, same batch
    assert loss_lines(with_optim.stdout)[6] != loss_lines(without.stdout)[6]  # different updates


def test_resume_with_dropout_is_bitwise_identical(tmp_path):
    """Dropout draws from the default and the per-TP-rank streams: both are checkpointed."""
    dropout = [
        *SMALL_MODEL,
        "--train-iters",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--hidden-dropout",
        "0.1",
        "--attention-dropout",
        "0.1",
    ]
    straight = ok(run_pretrain(dropout, tmp_path))
    without = ok(
        run_pretrain([*SMALL_MODEL, "--train-iters", "8", "--tensor-model-parallel-size", "2"], tmp_path)
    )
    assert loss_lines(straight.stdout)[1] != loss_lines(without.stdout)[1]  # dropout is really applied
    ok(run_pretrain([*dropout, "--save", "c", "--exit-interval", "4"], tmp_path))
    resumed = ok(run_pretrain([*dropout, "--load", "c"], tmp_path))
    assert {it: loss_lines(straight.stdout)[it] for it in range(5, 9)} == loss_lines(resumed.stdout)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (
            ["--normalization", "RMSNorm"],
            "normalization='LayerNorm' but --normalization gives normalization='RMSNorm'",
        ),
        (["--swiglu", "--ffn-hidden-size", "256"], "gated_linear_unit=False but --swiglu"),
        (["--position-embedding-type", "rope"], "position_embedding_type='learned_absolute'"),
        (["--group-query-attention", "--num-query-groups", "2"], "num_query_groups=4 but --num-query-groups"),
        (["--untie-embeddings-and-output-weights"], "share_embeddings_and_output_weights=True"),
    ],
)
def test_other_architecture_is_refused_naming_the_difference(saved_pp2, flags, needle):
    refused(saved_pp2, ["--pipeline-model-parallel-size", "2", *flags], needle)


def test_resume_with_recompute_is_bitwise_identical(tmp_path):
    """Recomputation replays the RNG streams of the forward it repeats; resuming restores them all."""
    recompute = [
        *SMALL_MODEL,
        *"--train-iters 8 --pipeline-model-parallel-size 2 --hidden-dropout 0.1 --attention-dropout 0.1".split(),
        *"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split(),
    ]
    straight = ok(run_pretrain(recompute, tmp_path))
    ok(run_pretrain([*recompute, "--save", "c", "--exit-interval", "4"], tmp_path))
    resumed = ok(run_pretrain([*recompute, "--load", "c"], tmp_path))
    assert {it: loss_lines(straight.stdout)[it] for it in range(5, 9)} == loss_lines(resumed.stdout)
