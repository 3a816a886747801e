"""Pipeline-true memory dashboards, end to end: real gloo runs, real event files, real sinks."""

from __future__ import annotations

import glob
import zipfile

import pytest
import torch.distributed as dist
from dist_helpers import REPO, SMALL_MODEL, run_pretrain, run_script, run_world
from event_files import scalars
from wandb_offline import read_history

MEMORY_REPORT = REPO / "tools" / "memory_report.py"

pytestmark = pytest.mark.world  # every test here starts processes

PP, ITERS = 4, 4
UNIFORM = (
    f"--pipeline-model-parallel-size {PP} --num-layers 8 --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 64 --max-position-embeddings 64 --vocab-size 128 --micro-batch-size 2 --global-batch-size 16 "
    f"--train-iters {ITERS}"
).split()


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "reduce",
    "gather",
    "all_to_all",
)


def _train_recording_reports(rank, world, argv):
    """Run the real pretrain() on this rank, recording every report this rank's training_log makes and
    the number of collectives each logged step's memory metrics take."""
    import megatron_lite.training.training as training
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.gpt_step import forward_step
    from megatron_lite.training.memory import pipeline
    from megatron_lite.training.pretrain import pretrain

    recorded, collectives = [], []
    real_report, real_metrics = pipeline.report_memory, training.memory_metrics

    def recording(memory_keys=None):
        report = real_report(memory_keys)
        recorded.append(dict(report))
        return report

    def counting(*args, **kwargs):
        calls, originals = [0], {name: getattr(dist, name) for name in _COLLECTIVES}

        def counted(original):
            def call(*a, **k):
                calls[0] += 1
                return original(*a, **k)

            return call

        for name, original in originals.items():
            setattr(dist, name, counted(original))
        try:
            metrics = real_metrics(*args, **kwargs)
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
        if metrics is not None:
            collectives.append(calls[0])
        return metrics

    pipeline.report_memory, training.memory_metrics = recording, counting
    pretrain(parse_args(argv), forward_step)
    assert not dist.is_initialized()
    return recorded, collectives


@pytest.mark.parametrize("per_stage", [False, True], ids=["reduce", "per-stage-gather"])
def test_logged_memory_is_the_max_of_every_stage_own_report(tmp_path, per_stage):
    """The mission: every PP rank measures and reduces (one collective per logged step), the last
    rank alone writes, and what it writes is the max of every stage's own report; 1F1B puts the
    peak on stage 0."""
    tb = tmp_path / "tb"
    argv = [*UNIFORM, "--log-memory-to-tensorboard", "--tensorboard-dir", str(tb)]
    if per_stage:
        argv.append("--log-memory-per-pp-stage")
    results = run_world(_train_recording_reports, PP, argv)
    reports = [recorded for recorded, _ in results]  # reports[rank][step - 1]
    assert all(len(r) == ITERS for r in reports)
    assert all(collectives == [1] * ITERS for _, collectives in results)
    assert len(glob.glob(str(tb / "events.out.tfevents.*"))) == 1
    logged = scalars(tb)
    names = list(reports[0][0])
    assert "mem-max-activation-gigabytes" in names and "mem-max-rss-gigabytes" in names
    for step in range(1, ITERS + 1):
        for name in names:
            expected = max(reports[rank][step - 1][name] for rank in range(PP))
            assert logged[f"memory/{name}"][step] == pytest.approx(expected, rel=1e-6), (step, name)
            if per_stage:
                for stage in range(PP):
                    own = reports[stage][step - 1][name]
                    assert logged[f"memory/pp-stage-{stage}/{name}"][step] == pytest.approx(own, rel=1e-6)
    # 1F1B keeps pp - i microbatches alive on stage i: stage 0 holds the peak, about twice stage 2's.
    peaks = [reports[rank][-1]["mem-max-activation-gigabytes"] for rank in range(PP)]
    assert peaks[0] == max(peaks) and 1.8 <= peaks[0] / peaks[2] <= 2.2, peaks
    assert logged["memory/mem-max-activation-gigabytes"][ITERS] == pytest.approx(peaks[0])
    assert logged["memory/peak-stage"][ITERS] == 0


def _train_with_fake_cuda_stats(rank, world, argv):
    """pretrain() on this rank as if on CUDA: the allocator statistics are fakes that differ by rank."""
    import torch

    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.gpt_step import forward_step
    from megatron_lite.training.memory import keys, pipeline, report
    from megatron_lite.training.pretrain import pretrain

    stats = {key: (rank + 1) * 10**9 for key in keys.MEMORY_KEYS}
    stats.update({"num_alloc_retries": 5 - rank, "num_ooms": 0, "allocation.all.current": 100 + rank})
    stats["allocated_bytes.all.current"] = (rank + 1) * 10**9 // 2  # half of what is reserved
    report._cuda_in_use = lambda: True
    torch.cuda.memory_stats = lambda *a, **k: dict(stats)
    pipeline.device_memory_capacity_gigabytes = lambda: 80.0
    pretrain(parse_args(argv), forward_step)


def test_cuda_run_dashboard_tags_are_upstreams(tmp_path):
    """With CUDA statistics, the memory/* tags are upstream's MEMORY_KEYS names (gigabytes, upstream's
    spelling), beside our extras, each the max over the pipeline stages."""
    tb = tmp_path / "tb"
    argv = [*UNIFORM[:-1], "2", "--log-memory-to-tensorboard", "--tensorboard-dir", str(tb)]
    argv[argv.index("--pipeline-model-parallel-size") + 1] = "2"
    run_world(_train_with_fake_cuda_stats, 2, argv)
    logged = {k: v for k, v in scalars(tb).items() if k.startswith("memory/")}
    upstream = [
        "mem-allocated-gigabytes",
        "mem-active-gigabytes",
        "mem-inactive-gigabytes",
        "mem-reserved-gigabytes",
        "mem-max-allocated-gigabytes",
        "mem-max-active-gigabytes",
        "mem-max-inactive-gigabytes",
        "mem-max-reserved-gigabytes",
        "mem-alloc-retires",
        "mem-allocated-count",
    ]
    ours = [
        "mem-ooms",
        "mem-fragmentation",  # (reserved - allocated) / reserved
        "mem-alloc-retries-delta",
        "mem-activation-gigabytes",
        "mem-max-activation-gigabytes",
        "mem-optimizer-state-gigabytes",  # measured from the training run's optimizer
        "mem-weights-gigabytes",
        "mem-grads-gigabytes",
        "mem-other-gigabytes",
        "mem-max-other-gigabytes",
        "mem-temporaries-gigabytes",  # the allocator's peak less the static parts and saved peak
        "capacity-gigabytes",
        "peak-stage",
        "pp-imbalance",
    ]
    # theoretical_memory's prediction, logged once at start for each stage, labelled as one.
    predicted = [
        f"pp-stage-{stage}/predicted-{q}-gigabytes"
        for stage in range(2)
        for q in (
            "weights",
            "grads",
            "optimizer-state",
            "max-activation",
            "total",
            "temporaries",
            "max-allocated",
        )
    ]
    assert sorted(logged) == sorted(f"memory/{name}" for name in upstream + ours + predicted)
    assert logged["memory/mem-max-reserved-gigabytes"] == {1: 2.0, 2: 2.0}  # stage 1's, the larger
    assert logged["memory/mem-alloc-retires"][2] == 5 and logged["memory/mem-allocated-count"][2] == 101
    assert logged["memory/mem-fragmentation"][2] == pytest.approx(0.5)
    assert logged["memory/mem-alloc-retries-delta"] == {1: 0, 2: 0}  # the count did not change
    assert logged["memory/peak-stage"] == {1: 1, 2: 1} and logged["memory/pp-imbalance"][2] == 2.0


def test_cli_run_writes_every_sink(tmp_path, monkeypatch):
    tb, wb, comet = tmp_path / "tb", tmp_path / "wb", tmp_path / "comet"
    result = run_pretrain(
        [
            *UNIFORM,
            "--log-memory-to-tensorboard",
            "--tensorboard-dir",
            str(tb),
            "--wandb-project",
            "megatron-lite-test",
            "--wandb-exp-name",
            "memory",
            "--wandb-save-dir",
            str(wb),
            "--mlflow-experiment",
            "memory",
            "--mlflow-run-name",
            "pp4",
            "--mlflow-tracking-uri",
            f"file:{tmp_path / 'mlruns'}",
            "--comet-project",
            "megatron-lite-test",
            "--comet-experiment-name",
            "memory",
            "--comet-offline-directory",
            str(comet),
        ],
        tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr
    key = "memory/mem-max-activation-gigabytes"

    # TensorBoard: one events file (the writer rank's), memory at every step.
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    logged = scalars(tb)
    assert sorted(logged[key]) == list(range(1, ITERS + 1))

    # W&B offline: the run's transaction log holds the memory keys at every step.
    runs = glob.glob(str(wb / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    history = [row for row in read_history(runs[0]) if key in row]
    assert [row["_step"] for row in history] == list(range(1, ITERS + 1))
    assert history[-1][key] == pytest.approx(logged[key][ITERS])

    # MLflow local file store.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    run = client.search_runs([client.get_experiment_by_name("memory").experiment_id])[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "pp4"
    metric = client.get_metric_history(run.info.run_id, key)
    assert sorted(m.step for m in metric) == list(range(1, ITERS + 1))
    assert {m.step: m.value for m in metric}[ITERS] == pytest.approx(logged[key][ITERS])

    # Comet offline archive.
    archives = list(comet.glob("*.zip"))
    assert len(archives) == 1
    with zipfile.ZipFile(archives[0]) as z:
        assert any(key.encode() in z.read(name) for name in z.namelist())

    # tools/memory_report.py over the same run.
    png = tmp_path / "memory.png"
    report = run_script(MEMORY_REPORT, [str(tb), "--png", str(png)], tmp_path, timeout=120)
    assert report.returncode == 0, report.stderr
    line = next(ln for ln in report.stdout.splitlines() if ln.startswith("mem-max-activation-gigabytes"))
    assert f"{logged[key][ITERS]:.6g}" in line
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_memory_flag_without_dir_logs_to_a_printed_default(tmp_path):
    # The last iteration (3) is not logged, so it runs untracked: the table still shows the peaks.
    argv = [
        *SMALL_MODEL,
        "--train-iters",
        "3",
        "--tensorboard-log-interval",
        "2",
        "--log-memory-to-tensorboard",
    ]
    result = run_pretrain(argv, tmp_path)
    assert result.returncode == 0, result.stderr
    line = next(ln for ln in result.stdout.splitlines() if "TensorBoard logs:" in ln)
    logdir = tmp_path / line.split("TensorBoard logs:")[1].strip()
    assert logdir.is_dir() and len(list(logdir.glob("events.out.tfevents.*"))) == 1
    assert "memory/mem-max-activation-gigabytes" in scalars(logdir)
    lines = result.stdout.splitlines()
    title = next(i for i, ln in enumerate(lines) if "memory per pipeline stage (MiB" in ln)
    assert "pred: predicted" in lines[title]
    # Short columns, the measured peak beside the predicted one and their error, 120 columns at most.
    assert lines[title + 1].split() == "stage weights grads optim act temp peak rss pred err%".split()
    row = lines[title + 2].split()
    assert row[0] == "0" and len(row) == 10 and abs(float(row[-1])) < 10
    assert all(len(ln) <= 120 for ln in lines[title : title + 3])


def test_logger_that_cannot_start_fails_every_rank_with_one_line(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    result = run_pretrain(
        [
            *SMALL_MODEL,
            "--pipeline-model-parallel-size",
            "2",
            "--train-iters",
            "2",
            "--tensorboard-dir",
            str(tmp_path / "a_file" / "tb"),
        ],
        tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "could not start tensorboard" in result.stderr and "Traceback" not in result.stderr


def _lazy_loggers(rank, world, logdir):
    from megatron_lite.training.config import ConfigContainer
    from megatron_lite.training.state import GlobalState

    cfg = ConfigContainer()
    cfg.logger.tensorboard_dir = logdir
    state = GlobalState(cfg)
    created_before = state._tensorboard_logger is not None
    writer = state.tensorboard_logger
    others = (state.wandb_logger, state.mlflow_logger, state.comet_logger)
    if writer is not None:
        writer.add_scalar("x", 1.0, 1)
    state.close_loggers()
    return created_before, writer is not None, others


def test_loggers_are_created_lazily_on_the_last_rank_only(tmp_path):
    results = run_world(_lazy_loggers, 2, str(tmp_path))
    assert results[0] == (False, False, (None, None, None))
    assert results[1] == (False, True, (None, None, None))
    assert scalars(tmp_path)["x"] == {1: 1.0}


def _memory_report(logdir):
    """tools/memory_report.py over ``logdir``, as a user runs it (its own process, forked from the
    preloaded server)."""
    return run_script(MEMORY_REPORT, [str(logdir)], logdir, timeout=60)


def test_memory_report_tool_names_the_stage_and_headroom(tmp_path):
    """A CUDA-like run logged per stage with the device capacity: the tool attributes the peak."""

    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        for step in (1, 2, 3):
            for stage, peak in enumerate([60.0, 45.0, 30.0, 20.0]):
                writer.add_scalar(f"memory/pp-stage-{stage}/mem-max-allocated-gigabytes", peak + step, step)
            writer.add_scalar("memory/mem-max-allocated-gigabytes", 60.0 + step, step)
            writer.add_scalar("memory/capacity-gigabytes", 80.0, step)
    result = _memory_report(tmp_path)
    assert result.returncode == 0, result.stderr
    row = next(ln for ln in result.stdout.splitlines() if ln.startswith("mem-max-allocated-gigabytes"))
    assert row.split()[1:] == ["63", "3", "pp", "stage", "0", "17.000"]


def test_memory_report_tool_names_the_peak_stage_of_a_default_run(tmp_path):
    """Without per-stage tags, the headline's row takes its stage from memory/peak-stage at its step."""

    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        for step, (peak, stage) in enumerate([(50.0, 3), (70.0, 1), (65.0, 0)], start=1):
            writer.add_scalar("memory/mem-max-allocated-gigabytes", peak, step)
            writer.add_scalar("memory/mem-allocated-gigabytes", peak / 2, step)
            writer.add_scalar("memory/peak-stage", stage, step)
            writer.add_scalar("memory/pp-imbalance", 1.5, step)
    result = _memory_report(tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {
        ln.split()[0]: ln.split()[1:]
        for ln in result.stdout.splitlines()
        if ln.startswith(("mem-", "peak", "pp-"))
    }
    assert rows["mem-max-allocated-gigabytes"][:5] == ["70", "2", "pp", "stage", "1"]
    assert rows["mem-allocated-gigabytes"][2] == "n/a"  # only the headline's stage is known
    assert "peak-stage" not in rows and "pp-imbalance" not in rows  # they annotate, they are not memory


def test_memory_report_tool_compares_measured_and_predicted_per_stage(tmp_path):
    """Each stage's measured peak beside the prediction logged at start, with the error in %; a
    prediction without a measurement (the total) is left out of the comparison."""

    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        for stage, (predicted, measured) in enumerate([(10.0, 8.0), (5.0, 5.0)]):
            tag = f"memory/pp-stage-{stage}/"
            writer.add_scalar(tag + "predicted-max-activation-gigabytes", predicted, 0)
            writer.add_scalar(tag + "predicted-total-gigabytes", 3 * predicted, 0)
            for step in (1, 2):
                writer.add_scalar(tag + "mem-max-activation-gigabytes", measured - 2 + 2 * (step - 1), step)
    result = _memory_report(tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("measured vs predicted"))) + 2 :]
    assert [row.split() for row in table] == [
        ["pp", "0", "mem-max-activation-gigabytes", "8", "10", "+25.00"],
        ["pp", "1", "mem-max-activation-gigabytes", "5", "5", "+0.00"],
    ]
    assert not any(ln.startswith("predicted-") for ln in lines)  # not in the measured-peak table


def test_memory_report_tool_refuses_a_run_without_memory(tmp_path):

    result = _memory_report(tmp_path)
    assert result.returncode == 2 and "no memory/* scalars" in result.stderr
