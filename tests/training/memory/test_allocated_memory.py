"""The allocated peak on CPU: measured (temporaries included), cross-checked, and predicted per stage."""

from __future__ import annotations

import functools

import pytest
import torch
from memory_measure import PEAK_CASES, measure, peak_argv, profiler_peak_and_final

from megatron_lite.training.memory.allocated import AllocatedMemoryTracker
from megatron_lite.training.training import _tracks_memory


def _step() -> list[torch.Tensor]:
    """A forward, backward and AdamW step with what a model does: matmuls, GELU, fused attention, an
    fp32 cross entropy over a vocabulary, autograd's buffers and the optimizer's state and scratch."""
    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)
    w1 = torch.randn(1024, 256, requires_grad=True)
    w2 = torch.randn(4096, 1024, requires_grad=True)
    h = torch.nn.functional.gelu(x @ w1.t())
    q = h.view(256, 8, 128).transpose(0, 1).unsqueeze(0)
    a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    logits = a.squeeze(0).transpose(0, 1).reshape(256, 1024) @ w2.t()
    loss = torch.nn.functional.cross_entropy(logits.float(), torch.randint(0, 4096, (256,)))
    loss.backward()
    optimizer = torch.optim.AdamW([x, w1, w2], lr=1e-3)
    optimizer.step()
    return [x, w1, w2, optimizer]


def test_allocated_bytes_agree_with_the_profilers_memory_events():
    tracker = AllocatedMemoryTracker()
    with tracker.track():
        baseline = tracker.current_bytes  # what existed before: the profiler does not see it
        kept = _step()
    peak, final = tracker.peak_bytes - baseline, tracker.current_bytes - baseline
    profiler_peak, profiler_final, _ = profiler_peak_and_final(_step)
    assert profiler_peak > 30e6  # the step's tensors, not noise
    assert abs(peak - profiler_peak) <= 0.01 * profiler_peak, (peak, profiler_peak)
    assert abs(final - profiler_final) <= 0.01 * profiler_final, (final, profiler_final)
    del kept


def test_freed_storages_are_uncounted_and_the_peak_kept():
    tracker = AllocatedMemoryTracker()
    with tracker.track():
        base = tracker.current_bytes
        a = torch.ones(1000, 1000)  # 4 MB
        b = a * 2  # another 4 MB, a temporary
        view = b[:10]  # a view: no new storage
        del b
        peak_with_b = tracker.peak_bytes - base
        assert tracker.current_bytes - base == 8_000_000  # the view keeps b's storage alive
        del view
        assert tracker.current_bytes - base == 4_000_000
        a.add_(1)  # in place: nothing new
    assert peak_with_b == 8_000_000 and tracker.peak_bytes - base == 8_000_000
    assert tracker.stats()["allocated_bytes.all.peak"] == tracker.peak_bytes
    del a


def test_an_untracked_iteration_counts_nothing_and_keeps_the_peak_since_start():
    tracker = AllocatedMemoryTracker()
    with tracker.track(enabled=False):
        x = torch.ones(1000, 1000)
    assert tracker.current_bytes == 0 and tracker.peak_bytes == 0 and tracker.stats() == {}
    with tracker.track():
        y = x * 2
    peak = tracker.peak_bytes
    with tracker.track(enabled=False):
        z = x * 3  # not counted: no mode
    assert tracker.peak_bytes == peak
    # The last step was untracked: its current bytes are unknown, the peak since start is not.
    assert set(tracker.stats()) == {"allocated_bytes.all.peak", "temporaries_bytes.peak"}
    del x, y, z


def test_only_reported_iterations_and_the_first_two_are_tracked():
    class Logger:
        log_memory_to_tensorboard, tensorboard_log_interval, log_interval = True, 5, 10

    tracked = [i for i in range(1, 21) if _tracks_memory(Logger, i, 0, report_memory_flag=False)]
    assert tracked == [1, 2, 5, 10, 15, 20]
    Logger.log_memory_to_tensorboard = False  # the console memory line alone: its iterations
    tracked = [i for i in range(1, 31) if _tracks_memory(Logger, i, 0, report_memory_flag=True)]
    assert tracked == [1, 2, 10, 20, 30]
    assert not any(_tracks_memory(Logger, i, 0, report_memory_flag=False) for i in range(1, 31))


@functools.cache
def _measured(name: str, *extra: str):
    import tempfile

    argv, world = peak_argv(name, *extra)
    with tempfile.TemporaryDirectory() as tmp:
        return measure(argv, world, f"{tmp}/tb", quiet=True)


@pytest.mark.world
@pytest.mark.parametrize("name", list(PEAK_CASES))
def test_predicted_allocated_peak_is_within_3_percent_on_every_stage(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for stage, q in enumerate(_measured(name)):
        measured, predicted = q["peak"]
        assert abs(predicted - measured) <= 0.03 * measured, (name, stage, measured, predicted)
        # The peak holds at least the static parts and the saved activations' own peak.
        floor = sum(q[k][0] for k in ("weights", "grads", "optimizer", "activations"))
        assert measured >= floor * (1 - 1e-4), (name, stage, measured, floor)


@pytest.mark.world
def test_a_larger_vocabulary_grows_the_last_stages_peak_by_at_least_its_fp32_logits(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    small = _measured("full recompute pp2")[-1]["peak"]
    large = _measured("full recompute pp2", "--vocab-size", "16384")[-1]["peak"]
    tokens = 64 * 2  # seq x micro-batch
    logits = tokens * (16384 - 8192) * 4 / 1e9  # the fp32 logits the extra vocabulary adds, GB
    assert large[0] - small[0] >= logits, (small, large)  # measured
    assert large[1] - small[1] >= logits, (small, large)  # predicted


@pytest.mark.world
@pytest.mark.parametrize("name", ["1f1b pp4", "interleaved pp2 vp2", "full recompute pp2", "tp2 pp2 sp"])
def test_the_dry_run_measures_every_stages_peak_within_2_percent_of_the_real_run(name, monkeypatch, tmp_path):
    """The preflight's dry run (fake tensors, a fake world, the stage's real code and schedule) against
    the real gloo run's measured mem-max-allocated, stage by stage. The real run drives all 8
    microbatches, the dry run the fewest that reach the same in-flight counts (2 to 4 here): the same
    peak, which this also checks."""
    from megatron_lite.run_modes.dry_run import dry_run_stages
    from megatron_lite.training.arguments import config_from_argv

    monkeypatch.chdir(tmp_path)
    argv, _ = peak_argv(name)
    dry = dry_run_stages(config_from_argv(argv))
    assert list(tmp_path.iterdir()) == []  # nothing written
    measured = [q["peak"][0] * 1e9 for q in _measured(name)]
    assert len(dry) == len(measured)
    for stage, (d, m) in enumerate(zip(dry, measured)):
        assert abs(d.max_allocated_bytes - m) <= 0.02 * m, (name, stage, m, d.max_allocated_bytes)
