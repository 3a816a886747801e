"""report_memory, reduce_max_memory_across_pp_group and the per-stage gather."""

from __future__ import annotations

import pytest
import torch
import torch.distributed
from dist_helpers import run_world

from megatron_lite.core.utils import get_collective_device
from megatron_lite.training.memory.saved_tensors import ActivationMemoryTracker
from megatron_lite.training.utils import train_utils
from megatron_lite.training.utils.train_utils import (
    MEMORY_KEYS,
    gather_memory_across_pp_group,
    reduce_max_memory_across_pp_group,
    report_memory,
)

REPORT = {"mem-max-allocated-gigabytes": 1.5, "mem-alloc-retires": 2, "mem-ooms": 0, "flag": True}


def test_without_a_process_group_the_report_comes_back_as_given(mocker):
    assert not torch.distributed.is_initialized()  # this test process runs no world
    assert reduce_max_memory_across_pp_group(REPORT, object()) is REPORT
    # A torch built without distributed cannot be had here: that one is stood in for.
    mocker.patch("torch.distributed.is_available", return_value=False)
    assert reduce_max_memory_across_pp_group(REPORT, object()) is REPORT


def test_nccl_group_reduces_on_the_current_cuda_device(mocker):
    """No CUDA here: the backend and device are stood in for."""
    group = mocker.Mock(size=lambda: 2)
    mocker.patch("torch.distributed.get_backend", return_value="nccl")
    mocker.patch("torch.cuda.current_device", return_value=3)
    assert get_collective_device(group) == torch.device("cuda", 3)
    mocker.patch("torch.distributed.get_backend", return_value="gloo")
    assert get_collective_device(group) == torch.device("cpu")


def _reductions_in_a_real_world(rank, world):
    """Every rule of the reduction, in one real world: what each call returns and which collectives
    it made (the real ones, counted on the way through)."""
    seen: list[tuple] = []
    real_all_reduce = torch.distributed.all_reduce

    def counted(tensor, op=None, group=None, **kwargs):
        seen.append((tensor.dtype, tensor.device.type, op, tensor.tolist()))
        return real_all_reduce(tensor, op=op, group=group, **kwargs)

    torch.distributed.all_reduce = counted
    everyone = torch.distributed.new_group(list(range(world)))
    alone = [torch.distributed.new_group([r]) for r in range(world)][rank]
    report = {"mem-max-allocated-gigabytes": 0.5 * (world - rank), "mem-alloc-retires": rank * 3}
    report |= {"mem-ooms": int(rank == 2), "flag": rank == 1}
    before = dict(report)
    out = {
        "empty": reduce_max_memory_across_pp_group({}, everyone),
        "no size": [reduce_max_memory_across_pp_group(report, g) is report for g in (object(), None)],
        "alone": reduce_max_memory_across_pp_group(report, alone) is report,
        "collectives before": list(seen),
        "reduced": reduce_max_memory_across_pp_group(report, everyone),
    }
    out["collectives"] = seen[len(out["collectives before"]) :]
    out["peak"], out["stages"] = gather_memory_across_pp_group(report, everyone)
    out["mutated"] = report != before
    torch.distributed.all_reduce = real_all_reduce
    return report, out


@pytest.mark.world
def test_the_reduction_in_a_real_gloo_world_of_four():
    results = run_world(_reductions_in_a_real_world, 4)
    reports = [report for report, _ in results]
    for report, out in results:
        # Nothing to reduce, or no group to reduce over: the input back, no collective.
        assert out["empty"] == {} and out["no size"] == [True, True] and out["alone"]
        assert out["collectives before"] == []
        # Otherwise one float64 MAX all-reduce on the CPU (gloo), the values in the report's key order.
        ((dtype, device, op, sent),) = out["collectives"]
        assert (dtype, device, op) == (torch.float64, "cpu", torch.distributed.ReduceOp.MAX)
        assert sent == [float(v) for v in report.values()]
        expected = {"mem-max-allocated-gigabytes": 2.0, "mem-alloc-retires": 9, "mem-ooms": 1, "flag": 1.0}
        assert out["reduced"] == expected and list(out["reduced"]) == list(report)
        assert type(out["reduced"]["mem-alloc-retires"]) is int and type(out["reduced"]["flag"]) is float
        assert not out["mutated"]
        assert out["peak"] == out["reduced"] and out["stages"] == reports


def test_report_memory_on_cpu_measures_rss_and_activations():
    tracker = train_utils.ACTIVATION_MEMORY
    x = torch.randn(256, 256, requires_grad=True)
    with tracker.track():
        y = (x * 2).exp().sum()
    report = report_memory()
    y.backward()
    assert set(report) == {
        "mem-rss-gigabytes",
        "mem-max-rss-gigabytes",
        "mem-activation-gigabytes",
        "mem-max-activation-gigabytes",
    }
    assert 0 < report["mem-rss-gigabytes"] <= report["mem-max-rss-gigabytes"]
    # exp saves its output (256 x 256 fp32); reported in GB rounded to 5 significant digits.
    assert report["mem-activation-gigabytes"] == float(f"{256 * 256 * 4 / 1e9:.5g}")
    assert all(v == float(f"{v:.5g}") for v in report.values())
    assert report_memory()["mem-max-activation-gigabytes"] >= report["mem-activation-gigabytes"]


def test_report_memory_on_cuda_converts_bytes_and_keeps_counters(mocker):
    mocker.patch.object(train_utils.ACTIVATION_MEMORY, "tracking", True)
    mocker.patch("torch.cuda.is_available", return_value=True)
    mocker.patch("torch.cuda.is_initialized", return_value=True)
    stats = {key: 123_456_789_012 for key in MEMORY_KEYS}
    stats.update({"num_alloc_retries": 4, "num_ooms": 1, "allocation.all.current": 77})
    mocker.patch("torch.cuda.memory_stats", return_value=stats)
    report = report_memory()
    assert report["mem-max-allocated-gigabytes"] == 123.46
    assert report["mem-reserved-gigabytes"] == 123.46
    assert report["mem-alloc-retires"] == 4 and type(report["mem-alloc-retires"]) is int
    assert report["mem-ooms"] == 1 and report["mem-allocated-count"] == 77
    assert "mem-max-activation-gigabytes" in report
    assert not any(k.endswith("-bytes") for k in report)
    only = report_memory({"num_alloc_retries": "mem-alloc-retires"})
    assert only == {"mem-alloc-retires": 4}


def test_an_untracked_step_reports_no_current_activations_and_no_other():
    tracker = ActivationMemoryTracker()
    x = torch.randn(64, 64, requires_grad=True)
    with tracker.track(enabled=False):
        (x * 2).exp().sum().backward()  # no hooks: nothing counted
    assert not tracker.tracking and tracker.peak_bytes == 0
    with tracker.track():
        y = x.exp().sum()
    assert tracker.tracking and tracker.current_bytes == 64 * 64 * 4
    y.backward()
    # The process-wide tracker after an untracked step: report_memory leaves its current bytes out.
    with train_utils.ACTIVATION_MEMORY.track(enabled=False):
        pass
    report = report_memory()
    assert report and "mem-activation-gigabytes" not in report and not any("other" in k for k in report)
    # The peak since start stays known once any step was tracked (the end-of-run table shows it).
    assert ("mem-max-activation-gigabytes" in report) == train_utils.ACTIVATION_MEMORY.tracked_once


def test_activation_tracker_counts_each_storage_once_and_releases_it():
    tracker = ActivationMemoryTracker()
    weight = torch.nn.Parameter(torch.randn(64, 64))
    tracker.exclude_parameters([weight])
    x = torch.randn(32, 64, requires_grad=True)
    with tracker.track():
        h = x @ weight  # saves x and weight (weight excluded)
        out = (h * h).sum()  # saves h twice: one storage
    assert tracker.current_bytes == x.numel() * 4 + h.numel() * 4
    out.backward()
    assert tracker.current_bytes == 0
    assert tracker.peak_bytes == x.numel() * 4 + h.numel() * 4


def test_cuda_allocator_health_fragmentation_and_retries_since_the_last_report(mocker):
    mocker.patch("torch.cuda.is_available", return_value=True)
    mocker.patch("torch.cuda.is_initialized", return_value=True)
    stats = {key: 0 for key in MEMORY_KEYS}
    stats.update({"reserved_bytes.all.current": 8 * 10**9, "allocated_bytes.all.current": 6 * 10**9})
    memory_stats = mocker.patch("torch.cuda.memory_stats")
    deltas = []
    for retries in (3, 3, 7, 10):
        memory_stats.return_value = {**stats, "num_alloc_retries": retries}
        report = report_memory()
        assert report["mem-fragmentation"] == 0.25  # 2 of 8 GB reserved are not allocated
        assert report["mem-inactive-gigabytes"] == 0.0  # upstream's inactive-split bytes, beside it
        deltas.append(report["mem-alloc-retries-delta"])
    assert deltas[1:] == [0, 4, 3] and type(deltas[-1]) is int


def test_weights_and_grads_are_measured_from_the_tensors_each_storage_once():
    from megatron_lite.training.memory.attribution import grads_bytes, weights_bytes

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(100, 16)
            self.head = torch.nn.Linear(16, 100, bias=False)
            self.head.weight = self.embedding.weight  # tied: one storage
            self.norm = torch.nn.LayerNorm(16, dtype=torch.bfloat16)
            self.buffers = [type("Buffer", (), {"grad_data": torch.zeros(1632)})()]

    chunk = Chunk()
    assert weights_bytes([chunk]) == 100 * 16 * 4 + 2 * 16 * 2
    assert grads_bytes([chunk]) == 1632 * 4
    chunk.norm.weight.grad = torch.zeros(16, dtype=torch.bfloat16)
    assert grads_bytes([chunk]) == 1632 * 4 + 16 * 2


def test_other_is_the_total_minus_the_measured_parts():
    from megatron_lite.training.memory.attribution import other_memory_stats

    parts = {"weights_bytes.current": 10, "grads_bytes.current": 20, "optimizer_state_bytes.current": 30}
    stats = {"rss_bytes.current": 500, "rss_bytes.peak": 900, "activation_bytes.current": 5}
    stats |= {"activation_bytes.peak": 300}
    assert other_memory_stats(stats) == {}  # nothing to attribute until the model is tracked
    assert other_memory_stats({**stats, **parts}) == {"other_bytes.current": 435, "other_bytes.peak": 540}
    cuda = {**parts, "allocated_bytes.all.current": 200, "allocated_bytes.all.peak": 400, "rss_bytes.peak": 1}
    # Untracked activations: "other" would silently hold them, so there is none.
    assert other_memory_stats(cuda) == {}
    cuda |= {"activation_bytes.current": 5, "activation_bytes.peak": 300}
    # CUDA's peak has no instant: the least the temporaries at it can be.
    assert other_memory_stats(cuda) == {
        "other_bytes.current": 135,
        "other_bytes.peak": 40,
        "temporaries_bytes.peak": 40,
    }


def test_stage_slots_carry_every_stage_headline_through_one_max():
    from megatron_lite.training.memory.pipeline import (
        peak_stage_metrics,
        split_stage_slots,
        with_stage_slots,
    )

    reports = [{"mem-max-rss-gigabytes": v, "mem-alloc-retires": 1} for v in (2.0, 3.0, 1.5, 3.0)]
    slotted = [with_stage_slots(r, stage, 4) for stage, r in enumerate(reports)]
    reduced = {k: max(s[k] for s in slotted) for k in slotted[0]}  # what the MAX all-reduce computes
    report, values = split_stage_slots(reduced, 4)
    assert report == {"mem-max-rss-gigabytes": 3.0, "mem-alloc-retires": 1}
    assert values == [2.0, 3.0, 1.5, 3.0]
    assert peak_stage_metrics(values) == {"memory/peak-stage": 1, "memory/pp-imbalance": 2.0}
    assert with_stage_slots(reports[0], 0, 1) is reports[0]  # one stage: nothing to learn
    assert split_stage_slots(reports[0], 4) == (reports[0], None)
    assert peak_stage_metrics([0.0, 1.0]) == {"memory/peak-stage": 1}  # no ratio over a zero


def _memory_metrics_with_growing_retries(rank, world):
    from megatron_lite.training.memory import pipeline

    logger = type("Logger", (), {"log_memory_to_tensorboard": True, "tensorboard_log_interval": 1})()
    logger.memory_keys, logger.log_memory_per_pp_stage = None, False
    pipeline.report_memory = lambda keys: {
        "mem-max-allocated-gigabytes": 1.0 + rank,
        "mem-alloc-retries-delta": 3,
    }
    pipeline.device_memory_capacity_gigabytes = lambda: None
    return pipeline.memory_metrics(logger, 1, torch.distributed.group.WORLD)


@pytest.mark.world
def test_growing_allocator_retries_print_one_hint_on_the_writer(capfd):
    results = run_world(_memory_metrics_with_growing_retries, 2)
    assert results[1]["memory/peak-stage"] == 1 and results[1]["memory/mem-alloc-retries-delta"] == 3
    hints = [line for line in capfd.readouterr().out.splitlines() if "retried" in line]
    assert len(hints) == 1 and "3 allocations" in hints[0] and "expandable_segments" in hints[0]
