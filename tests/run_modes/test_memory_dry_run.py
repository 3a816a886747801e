"""--memory-preflight --memory-dry-run: each stage's real code at full size on fake tensors, its
allocated peak beside the prediction. (Against real CPU runs, stage by stage: test_allocated_memory.py.)"""

from __future__ import annotations

import io
import json
import os
import re

import pytest
from dist_helpers import run_pretrain
from preflight_helpers import FIRST_STAGE_HEAVY, predicted_table, readme_cluster_argv

from megatron_lite.run_modes.dry_run import NOT_SIMULATED

pytestmark = pytest.mark.world  # every test here starts processes


def _dry_table(stdout: str) -> dict[int, tuple[float, float]]:
    """Stage -> (predicted peak, dry run peak) in GB, from the printed table."""
    number = r"\s+([-+]?[\d.]+(?:e-?\d+)?)"
    rows = re.findall(r"^\s+(\d+)" + number * 9 + "$", stdout, re.M)
    return {int(r[0]): (float(r[6]), float(r[8])) for r in rows}


def test_the_readme_cluster_example_at_full_size_its_dry_run_beside_the_prediction(tmp_path):
    """Llama-3-8B-shaped, tp 4 x pp 4, 256 microbatches, bf16: every stage measured, within 3% of the
    prediction; the time and what is not simulated printed; the JSON carries the dry run; nothing
    else written."""
    argv = [
        *readme_cluster_argv(),
        "--memory-preflight",
        "--device-memory-gb",
        "80",
        "--memory-dry-run",
        "--memory-preflight-json",
        "preflight.json",
    ]
    result = run_pretrain(argv, tmp_path, timeout=300)
    print(result.stdout)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert NOT_SIMULATED in result.stdout
    assert re.search(r"dry run took [\d.]+ s \(4 stages measured\)", result.stdout)
    table = _dry_table(result.stdout)
    assert sorted(table) == [0, 1, 2, 3]
    record = json.loads((tmp_path / "preflight.json").read_text())
    for s in record["stages"]:
        predicted, dry = s["predicted_max_allocated_bytes"], s["dry_run_max_allocated_bytes"]
        assert abs(predicted - dry) <= 0.03 * dry, (s["stage"], predicted, dry)
        assert f"{dry / 1e9:.3g}" == f"{table[s['stage']][1]:.3g}"
    assert sorted(os.listdir(tmp_path)) == ["preflight.json"]


def test_a_70b_shaped_job_reduced_agrees_with_the_prediction_within_3_percent_on_every_stage():
    """The 70B job's layout (tp 8 x pp 8, sequence parallel, distributed optimizer at dp 2, bf16,
    Llama's shape) at a width, length and depth a test affords; full size:
    bench/memory_prediction.py."""
    from megatron_lite.run_modes.dry_run import dry_run_stages
    from megatron_lite.training.arguments import config_from_argv
    from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

    argv = (
        "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --sequence-parallel "
        "--use-distributed-optimizer --bf16 --num-layers 8 --hidden-size 512 --num-attention-heads 8 "
        "--group-query-attention --num-query-groups 8 --ffn-hidden-size 1792 --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
        "--seq-length 1024 --max-position-embeddings 1024 --vocab-size 16384 --micro-batch-size 1 "
        "--global-batch-size 32 --nproc-per-node 128"
    ).split()
    config = config_from_argv(argv)
    dry = dry_run_stages(config, device_type="cuda")
    predicted = predict_memory_per_stage(config, device_type="cuda")
    assert [d.measured_as for d in dry] == list(range(8))  # 1F1B: every stage holds its own in flight
    for d, p in zip(dry, predicted):
        assert abs(p.peak_bytes - d.max_allocated_bytes) <= 0.03 * d.max_allocated_bytes, (d, p.peak_bytes)


def test_the_dry_run_confirms_the_lever_searchs_fix():
    """A first-stage-heavy layout misses the device by 5%: the fix the search finds is measured too."""
    from megatron_lite.run_modes.preflight import preflight

    argv = FIRST_STAGE_HEAVY
    out = io.StringIO()
    preflight(argv, 100, out)  # the prediction alone, to size the device
    device = round(max(predicted_table(out.getvalue()).values()) * 0.95 / 0.9, 3)
    out = io.StringIO()
    assert preflight(argv, device, out, dry_run=True) == 1
    text = out.getvalue()
    assert "cheapest change that fits every stage: --decoder-first-pipeline-num-layers 1" in text, text
    assert "the dry run confirms it" in text, text


def test_the_dry_run_without_the_preflight_is_one_line_and_exit_2(tmp_path):
    result = run_pretrain([*readme_cluster_argv(), "--memory-dry-run"], tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "pretrain.py: error: --memory-dry-run: is part of the preflight: give it with --memory-preflight"
    ]
    assert os.listdir(tmp_path) == []


def _tiny_config():
    from megatron_lite.training.arguments import config_from_argv

    return config_from_argv(
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--vocab-size 256 --micro-batch-size 1 --global-batch-size 8 --pipeline-model-parallel-size 4 "
        "--nproc-per-node 4".split()
    )


def test_a_stage_that_raises_is_one_line_and_stops_the_others():
    """A stage whose code raises (here: a stage the job does not have) ends the dry run with
    DryRunError naming it, its first line only; the stage running beside it is stopped."""
    import multiprocessing

    from megatron_lite.run_modes.dry_run import DryRunError
    from megatron_lite.run_modes.dry_run.processes import run_in_children

    with pytest.raises(DryRunError, match=r"^stage 9's dry run failed: IndexError: list index out of range$"):
        list(run_in_children(_tiny_config(), [0, 9], "cpu", workers=2))
    assert multiprocessing.active_children() == []


def test_a_stage_process_killed_is_one_line_and_nothing_hangs():
    """A stage's process killed from outside (as the OOM killer would) ends the dry run with
    DryRunError and its exit code, the stages after it never started."""
    import multiprocessing
    import signal
    import threading
    import time

    from megatron_lite.run_modes.dry_run import DryRunError
    from megatron_lite.run_modes.dry_run.processes import run_in_children

    def kill_the_first_stage():
        while not (children := multiprocessing.active_children()):
            time.sleep(0.01)
        os.kill(children[0].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_first_stage, daemon=True)
    killer.start()
    with pytest.raises(DryRunError, match=r"^stage 0's dry run died \(exit code -9\)$"):
        list(run_in_children(_tiny_config(), [0, 1, 2, 3], "cpu", workers=1))
    killer.join(timeout=10)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    "layout,fused",
    [
        ("--bf16", True),  # CUDA's flash kernel applies dropout inside itself
        ("--bf16 --context-parallel-size 2", True),  # a mask: the memory-efficient kernel
        ("--group-query-attention --num-query-groups 2", False),  # fp32 and grouped heads: math
    ],
)
def test_attention_dropout_on_a_gpu_keeps_probabilities_only_where_cuda_takes_the_math_path(layout, fused):
    """Megatron-LM's default attention dropout (0.1): on CUDA a fused kernel takes it and saves no
    s x s probabilities, except where PyTorch's kernel selection leaves only the math path (an explicit
    mask, context parallelism's, rules flash out; grouped-query heads the memory-efficient kernel).
    The prediction and the dry run (on fake tensors, the job's kernels) agree on both."""
    from megatron_lite.run_modes.dry_run import dry_run_stages
    from megatron_lite.training.arguments import config_from_argv
    from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

    base = (
        "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
        "--max-position-embeddings 512 --vocab-size 1024 --micro-batch-size 2 --global-batch-size 4 "
        "--nproc-per-node 2 --hidden-dropout 0.1 "
    )
    argv = lambda dropout: (base + layout + f" --attention-dropout {dropout}").split()  # noqa: E731
    with_dropout, without = (config_from_argv(argv(d)) for d in ("0.1", "0.0"))
    probs = 3 * 2 * 4 * 512 * 512 * 2 // with_dropout.model.context_parallel_size  # softmax, mask, dropped
    predicted = [predict_memory_per_stage(c, device_type="cuda")[0] for c in (with_dropout, without)]
    extra = predicted[0].activation_bytes - predicted[1].activation_bytes
    assert extra == 0 if fused else extra >= 2 * probs  # two layers' probabilities in flight, at least
    dry = dry_run_stages(with_dropout, device_type="cuda")[0].max_allocated_bytes
    assert abs(predicted[0].peak_bytes - dry) <= 0.03 * dry, (predicted[0].peak_bytes, dry)
