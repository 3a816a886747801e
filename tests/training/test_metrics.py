"""A step's metrics and their sinks: each sink's calls and naming quirks (upstream's), and a real run
that writes every sink (TensorBoard event files, W&B offline, MLflow's file store, Comet's offline
archive), read back and compared sink against sink."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from dist_helpers import run_world
from event_files import scalars
from tracking_stores import comet_metrics, mlflow_metrics
from wandb_offline import read_history

from megatron_lite.training.metrics import LOSSES, TFLOPS, TIMERS, VALIDATION, MetricsWriter, StepMetrics
from megatron_lite.training.metrics.sinks import mlflow_name


class Recorder:
    """Stands in for a logger: records its calls as (method, args, kwargs)."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def _record(self, method):
        def call(*args, **kwargs):
            self.calls.append((method, args, kwargs))
            if self.fail:
                raise ConnectionError("tracking server down")

        return call

    def __getattr__(self, method):
        return self._record(method)


def _step() -> StepMetrics:
    metrics = StepMetrics(4, samples=32)
    metrics.add({"train/forward-backward-time": 0.5, "optimizer-time": 0.25}, kind=TIMERS)
    metrics.add({"lm loss": torch.tensor([2.0]), "z": torch.tensor(1.0)}, vs_samples=True, kind=LOSSES)
    metrics.add({"samples vs steps": 32})
    metrics.add({"decoupled-learning-rate": 0.1})
    metrics.add({"throughput/tflops/device": 3.0, "throughput/tflops": 6.0}, kind=TFLOPS)
    metrics.add({"memory/ep-rank-0/a@b": 1.5, "none": None})
    metrics.add({"loss-scale": 1.0}, vs_samples=True, dashboards=False)  # the console's only
    return metrics


def test_each_sink_makes_upstreams_calls_with_its_naming_quirks():
    tb, wb, ml, comet = (Recorder() for _ in range(4))
    MetricsWriter(tb, wb, ml, comet).write_step(_step())
    loss = torch.tensor([2.0])
    assert [c[1][:1] + c[1][2:] for c in tb.calls] == [
        ("train/forward-backward-time", 4),
        ("optimizer-time", 4),
        ("lm loss", 4),
        ("lm loss vs samples", 32),
        ("z", 4),
        ("z vs samples", 32),
        ("decoupled-learning-rate", 4),
        ("throughput/tflops/device", 4),
        ("throughput/tflops", 4),
        ("memory/ep-rank-0/a@b", 4),
    ]
    assert torch.equal(tb.calls[2][1][1], loss)  # TensorBoard takes the tensor as given
    assert wb.calls == [
        ("log", ({"train/forward-backward-time": 0.5}, 4), {}),  # each timer in its own call
        ("log", ({"optimizer-time": 0.25}, 4), {}),
        ("log", ({"lm loss": 2.0}, 4), {}),  # each loss too, as numbers
        ("log", ({"z": 1.0}, 4), {}),
        ("log", ({"samples vs steps": 32}, 4), {}),
        ("log", ({"throughput/tflops/device": 3.0}, 4), {}),
        ("log", ({"throughput/tflops": 6.0}, 4), {}),
        ("log", ({"memory/ep-rank-0/a@b": 1.5}, 4), {}),
    ]
    assert [c[1][0] for c in ml.calls] == [
        {"train_forward-backward-time": 0.5, "optimizer-time": 0.25},  # a timer's every "/" made "_"
        {"lm loss": 2.0, "z": 1.0},  # the losses in one call
        {"samples vs steps": 32},
        {"throughput/tflops_per_device": 3.0, "throughput/tflops": 6.0},  # not inside throughput/tflops
        {"memory/ep-rank-0_a_at_b": 1.5},  # the first "/" only, "@" spelled out
    ]
    assert {c[2]["step"] for c in ml.calls + comet.calls} == {4}
    assert [c[1][0] for c in comet.calls] == [
        {"train/forward-backward-time": 0.5, "optimizer-time": 0.25},
        {"lm loss": 2.0, "z": 1.0},
        {"throughput/tflops/device": 3.0, "throughput/tflops": 6.0},
        {"memory/ep-rank-0/a@b": 1.5},
    ]


def test_the_console_reads_what_the_dashboards_do_not_get():
    metrics = _step()
    assert metrics["loss-scale"] == 1.0 and "none" not in metrics
    assert "loss-scale" not in str(metrics.dashboard_groups)


def test_a_tracking_server_failing_on_the_timers_warns_as_upstream_and_on_the_rest_raises():
    metrics = StepMetrics(4)
    metrics.add({"forward-backward-time": 0.5}, kind=TIMERS)
    with pytest.warns(UserWarning, match="Failed to log timer metrics to MLFlow"):
        MetricsWriter(mlflow=Recorder(fail=True)).write_step(metrics)
    metrics.add({"lm loss": 2.0}, kind=LOSSES)
    with pytest.warns(UserWarning), pytest.raises(ConnectionError):
        MetricsWriter(comet=Recorder(fail=True)).write_step(metrics)


def test_validation_results_have_upstreams_names_in_each_sink():
    metrics = StepMetrics(6, samples=48)
    metrics.add({"lm loss validation": 2.5}, vs_samples=True, kind=VALIDATION)
    metrics.add({"lm loss validation ppl": 12.2}, vs_samples=True, kind=VALIDATION)
    tb, wb, ml = Recorder(), Recorder(), Recorder()
    MetricsWriter(tb, wb, ml).write_step(metrics)
    assert [c[1][0] for c in tb.calls] == [
        "lm loss validation",
        "lm loss validation vs samples",
        "lm loss validation ppl",
        "lm loss validation ppl vs samples",
    ]
    assert [c[1][0] for c in wb.calls] == [{"lm loss validation": 2.5}, {"lm loss validation ppl": 12.2}]
    assert [c[1][0] for c in ml.calls] == [{"val/lm loss": 2.5}, {"val/lm loss ppl": 12.2}]


def test_mlflow_names_are_upstreams():
    assert mlflow_name("moe/tokens_imbalance/layer_1") == "moe/tokens_imbalance_layer_1"
    assert mlflow_name("moe/tokens_imbalance") == "moe/tokens_imbalance"  # so both can be metrics
    assert (
        mlflow_name("l2_norm/grad/module.decoder.layers.0.mlp") == "l2_norm/grad_module.decoder.layers.0.mlp"
    )
    assert mlflow_name("a//b@c!") == "a/b_at_c_"
    assert mlflow_name("lm loss") == "lm loss"


def test_upstream_code_writing_into_the_step_metrics_keeps_its_step():
    metrics = StepMetrics(7)
    metrics.add_scalar("load_balancing_loss", 0.5, 7)
    assert metrics["load_balancing_loss"] == 0.5 and metrics  # truthy though it holds one value
    assert StepMetrics(7)  # and when empty: upstream tests `if writer:`
    with pytest.raises(AssertionError, match="step 8"):
        metrics.add_scalar("z_loss", 0.1, 8)


def test_no_sinks_no_calls():
    writer = MetricsWriter()
    assert not writer
    writer.write_step(_step())  # nothing to write to, nothing raised


def _train_every_sink(rank, world, argv):
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", MLFLOW_ALLOW_FILE_STORE="true")
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.gpt_step import forward_step
    from megatron_lite.training.pretrain import pretrain

    cfg = parse_args(argv)
    lg = cfg.logger  # upstream's dashboard switches that have no Megatron-LM flag
    lg.log_world_size_to_tensorboard = lg.log_runtime_to_tensorboard = True
    lg.log_l2_norm_grad_to_tensorboard = lg.log_validation_ppl_to_tensorboard = True
    pretrain(cfg, forward_step)


@pytest.mark.world
def test_a_real_run_writes_the_same_step_metrics_to_every_sink(tmp_path, monkeypatch):
    """pp 2 with MoE, evaluation, timers, memory and the optional reports, TensorBoard every 2nd step
    and the console every 3rd: each sink holds upstream's names for it, at the same steps, with the
    same values (one timer gather shared by all)."""
    argv = (
        "--pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 32 --num-attention-heads 4 "
        "--seq-length 32 --max-position-embeddings 32 --vocab-size 128 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 6 --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 "
        "--eval-interval 3 --eval-iters 1 --log-interval 3 --tensorboard-log-interval 2 --timing-log-level 2 "
        "--log-timers-to-tensorboard --log-throughput-to-tensorboard --log-memory-to-tensorboard "
        "--log-params-norm --log-throughput"
    ).split()
    argv += ["--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project", "p", "--wandb-exp-name", "e"]
    argv += ["--wandb-save-dir", str(tmp_path / "wb"), "--mlflow-experiment", "e", "--mlflow-run-name", "r"]
    argv += ["--mlflow-tracking-uri", f"file:{tmp_path / 'mlruns'}", "--comet-project", "p"]
    argv += ["--comet-experiment-name", "e", "--comet-offline-directory", str(tmp_path / "comet")]
    run_world(_train_every_sink, 2, argv, timeout=300)

    tb = scalars(tmp_path / "tb")
    (run,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    wb: dict = {}
    for row in read_history(run):
        for name, value in row.items():
            if not name.startswith("_"):
                wb.setdefault(name, {})[row["_step"]] = value
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    ml = mlflow_metrics(f"file:{tmp_path / 'mlruns'}", "e")
    (archive,) = glob.glob(str(tmp_path / "comet" / "*.zip"))
    comet = comet_metrics(archive)

    # The tags themselves, pinned (every sink is compared with TensorBoard below).
    pinned = {
        name for name in tb if not name.startswith(("l2_norm/grad/module", "memory/", "moe/tokens_per"))
    }
    assert pinned == {
        "batch-generator-time", "batch-size", "batch-size vs samples", "forward-backward-time",
        "grad-norm", "grad-norm vs samples", "iteration-time", "l2_norm/grad/global", "learning-rate",
        "learning-rate vs samples", "lm loss", "lm loss validation", "lm loss validation vs samples",
        "lm loss validation ppl", "lm loss validation ppl vs samples",
        "lm loss vs samples", "load_balancing_loss", "loss-scale", "loss-scale vs samples",
        "moe/tokens_imbalance", "moe/tokens_imbalance/layer_1", "moe/tokens_imbalance/layer_2",
        "moe/tokens_imbalance/layer_3", "moe/tokens_imbalance/layer_4", "optimizer-time", "params-norm",
        "params-norm vs samples", "throughput/tflops", "throughput/tflops/device", "time/batches",
        "time/remaining_estimate", "time/samples", "time/tokens", "time/total", "world-size",
        "world-size vs samples",
    }  # fmt: skip
    assert len([name for name in tb if name.startswith("memory/")]) == 30
    curves = {name.removesuffix(" vs samples") for name in tb if name.endswith(" vs samples")}
    assert curves == {"learning-rate", "batch-size", "lm loss", "loss-scale", "world-size"} | {
        "grad-norm",
        "params-norm",
        "lm loss validation",
        "lm loss validation ppl",
    }
    names = {name for name in tb if not name.endswith(" vs samples")} | {"samples vs steps"}
    assert set(wb) == names
    renamed = {"throughput/tflops/device": "throughput/tflops_per_device"}
    renamed |= {"lm loss validation": "val/lm loss", "lm loss validation ppl": "val/lm loss ppl"}

    def in_mlflow(name):
        return mlflow_name(renamed.get(name, name))

    assert set(ml) == {in_mlflow(name) for name in names}
    assert set(comet) - names <= {"process duration"}  # Comet's own
    assert set(comet) & names == names - {"samples vs steps"}

    assert sorted(tb["learning-rate"]) == [2, 4, 6] and sorted(tb["iteration-time"]) == [3, 6]
    assert sorted(tb["lm loss validation"]) == [3, 6] and sorted(wb["samples vs steps"]) == [2, 4, 6]
    # MLflow keeps a name's first "/" only: the layer's tag is a file beside its headline's.
    assert sorted(ml["moe/tokens_imbalance_layer_1"]) == sorted(ml["moe/tokens_imbalance"]) == [2, 4, 6]
    assert tb["batch-size vs samples"] == {16: 8.0, 32: 8.0, 48: 8.0}
    for name in names - {"samples vs steps"}:
        for sink in (wb, ml, comet):
            got = sink[in_mlflow(name) if sink is ml else name]
            assert got.keys() == tb[name].keys(), name
            for step, value in tb[name].items():  # TensorBoard keeps float32
                assert got[step] == pytest.approx(value, rel=1e-6), (name, step)
    assert tb["forward-backward-time"][2] > 0
