"""--profile: torch.profiler traces per rank from a real pipeline job; Nsight Systems on CUDA only."""

from __future__ import annotations

import gzip
import json

import pytest
from dist_helpers import SMALL_MODEL, loss_lines, run_pretrain

from megatron_lite.training import profiling
from megatron_lite.training.arguments import parse_args
from megatron_lite.training.config.profiling import ProfilingConfig

PIPELINE = [*SMALL_MODEL, "--pipeline-model-parallel-size", "2", "--train-iters", "4", "--seed", "3"]


@pytest.mark.world
def test_each_profiled_rank_writes_a_trace_of_the_profiled_steps_and_losses_are_unchanged(tmp_path):
    for run in ("plain", "profiled"):
        (tmp_path / run).mkdir()
    plain = run_pretrain(PIPELINE, tmp_path / "plain")
    profile = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3"]
    profiled = run_pretrain(
        [*PIPELINE, *profile, "--profile-ranks", "0", "1", "--tensorboard-dir", "run/tb"],
        tmp_path / "profiled",
    )
    assert plain.returncode == 0 and profiled.returncode == 0, profiled.stderr
    assert loss_lines(profiled.stdout) == loss_lines(plain.stdout)
    traces = tmp_path / "profiled" / "run" / "torch_profile"
    assert sorted(p.name for p in traces.iterdir()) == ["rank-0.json.gz", "rank-1.json.gz"]  # no partials
    assert f" profiler traces: {traces.relative_to(tmp_path / 'profiled')}" in profiled.stdout
    for rank in (0, 1):
        events = json.loads(gzip.decompress((traces / f"rank-{rank}.json.gz").read_bytes()))["traceEvents"]
        names = {e.get("name", "") for e in events}
        # Upstream's schedule: one warm-up step, then steps start .. end - 1 recorded.
        assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#1", "ProfilerStep#2"}
        assert names & {"aten::mm", "aten::addmm", "aten::matmul"}


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--use-pytorch-profiler"], "--use-pytorch-profiler"),
        (["--profile-step-start", "2"], "--profile-step-start"),
        (["--profile"], "--profile"),  # Nsight Systems needs CUDA
        (["--profile", "--use-pytorch-profiler", "--train-iters", "5"], "--profile-step-end"),
        (["--profile", "--use-pytorch-profiler", "--pytorch-profiler-collect-chakra"], "--pytorch-profiler"),
    ],
)
def test_bad_profiler_flags_are_one_line(argv, flag, capsys, mocker):
    mocker.patch("torch.cuda.is_available", return_value=False)
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and flag in err, err


def test_profile_flags_map_onto_profiling_config():
    config = parse_args(
        ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4"]
        + ["--profile-ranks", "1", "3", "--pytorch-profiler-collect-shapes", "--train-iters", "5"]
    )
    p = config.profiling
    assert (p.use_pytorch_profiler, p.use_nsys_profiler) == (True, False)
    assert (p.profile_step_start, p.profile_step_end, p.profile_ranks) == (2, 4, [1, 3])
    assert p.pytorch_profiler_collect_shapes and config.logger.tensorboard_dir  # a default directory
    assert parse_args([]).profiling is None


def test_nsys_starts_and_stops_cuda_profiler_on_the_profiled_steps_only(mocker):
    cudart = mocker.patch("torch.cuda.cudart")
    mocker.patch("torch.cuda.check_error")
    nvtx = mocker.patch("torch.autograd.profiler.emit_nvtx")
    config = ProfilingConfig(
        use_nsys_profiler=True, profile_step_start=2, profile_step_end=3, profile_ranks=[0]
    )
    contexts = [profiling.handle_profiling_step(config, step, 0, None) for step in range(4)]
    assert [c is not None for c in contexts] == [False, False, True, False]
    assert profiling.handle_profiling_step(config, 2, 1, None) is None  # rank 1 is not profiled
    cudart.return_value.cudaProfilerStart.assert_called_once()
    for step in range(4):
        profiling.handle_profiling_stop(config, step, 0, None, contexts[2])
    cudart.return_value.cudaProfilerStop.assert_called_once()
    nvtx.return_value.__exit__.assert_called_once()


def test_empty_profile_ranks_profiles_every_rank():
    assert profiling.should_profile_rank(ProfilingConfig(profile_ranks=[]), 7)
    assert not profiling.should_profile_rank(ProfilingConfig(profile_ranks=[0]), 7)
    assert not profiling.should_profile_rank(None, 0)
