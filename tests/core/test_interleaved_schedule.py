"""Interleaved 1F1B (virtual pipeline stages): Megatron's schedule table and warmup counts (megatron-core
as the oracle), loss parity with one process, exact resume, and each stage's measured activation peak
equal to what the schedule keeps in flight."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import SMALL_MODEL, loss_lines, parse_losses, run_pretrain
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_lite.core.pipeline_parallel.schedule_order import (
    forward_backward_order,
    get_pp_rank_microbatches,
    get_schedule_table,
    in_flight_microbatch_chunks,
)
from megatron_lite.core.transformer.transformer_block import get_num_layers_to_build
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.transformer.transformer_layer import get_transformer_layer_offset

ITERS = 8
EIGHT_LAYERS = [*SMALL_MODEL, "--num-layers", "8", "--seed", "1234"]


@pytest.mark.parametrize(
    "microbatches,chunks,group", [(8, 2, 2), (16, 2, 4), (8, 4, 2), (12, 3, 4), (10, 2, 4)]
)
def test_schedule_table_and_warmup_are_megatron_cores(microbatches, chunks, group, mocker):
    from megatron.core.pipeline_parallel import schedules as upstream

    assert get_schedule_table(microbatches, chunks, group) == upstream.get_schedule_table(
        microbatches, chunks, group
    )
    for rank in range(group):
        communicator = mocker.Mock()
        communicator.pp_group.size.return_value = group
        communicator.pp_group.rank.return_value = rank
        communicator.virtual_pipeline_model_parallel_size = chunks
        theirs = upstream.get_pp_rank_microbatches(microbatches, chunks, group, p2p_communicator=communicator)
        assert get_pp_rank_microbatches(microbatches, chunks, group, group, rank) == tuple(theirs)


@pytest.mark.parametrize(
    "microbatches,chunks,pp", [(8, 1, 4), (3, 1, 4), (16, 2, 4), (8, 2, 2), (12, 3, 4), (8, 4, 2)]
)
def test_forward_backward_order_is_megatron_cores(microbatches, chunks, pp):
    """The order each rank runs its forwards and backwards in, against megatron-core's own conversion
    of its schedule table into that order (``convert_schedule_table_to_order``, which CUDA graphs
    replay: chunk c + 1 for a forward, -(c + 1) for a backward of chunk c) at upstream's warmup count."""
    from megatron.core.pipeline_parallel import schedules as upstream
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    table = upstream.get_schedule_table(microbatches, chunks, pp)
    for rank in range(pp):
        if chunks == 1:  # plain 1F1B (forward_backward_pipelining_without_interleaving)
            warmup = min(pp - rank - 1, microbatches)
        else:
            warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, microbatches * chunks)
        theirs = [
            ("F", c - 1) if c > 0 else ("B", -c - 1)
            for c in convert_schedule_table_to_order(warmup, chunks, table)
        ]
        ours = forward_backward_order(microbatches, chunks, pp, rank)
        assert ours == theirs, rank
        # In flight at most: the warmup forwards and the one that starts the steady state.
        timeline = in_flight_microbatch_chunks(microbatches, chunks, pp, rank)
        assert len(timeline) == microbatches * chunks
        assert max(sum(step) for step in timeline) == min(warmup + 1, microbatches * chunks)


def test_chunk_layer_assignment_is_megatron_s():
    config = TransformerConfig(
        num_layers=16, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2
    )
    # Chunk c of rank r holds layers from (c * pp + r) * 2: rank 1 holds 2-3 and 10-11.
    assert [get_num_layers_to_build(config, c, pp_rank=1) for c in (0, 1)] == [2, 2]
    assert [get_transformer_layer_offset(config, c, pp_rank=1) for c in (0, 1)] == [2, 10]


def _losses(tmp_path, args) -> dict[int, float]:
    result = run_pretrain([*EIGHT_LAYERS, "--train-iters", str(ITERS), *args], tmp_path)
    assert result.returncode == 0, result.stderr
    return parse_losses(result.stdout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("ref"), [])


@pytest.mark.world
@pytest.mark.parametrize(
    "pp,vp,tp,dp", [(2, 2, 1, 1), (4, 2, 1, 1), (2, 4, 1, 1), (2, 2, 2, 1), (2, 2, 1, 2)]
)
def test_interleaved_loss_matches_single_process(tmp_path, reference, pp, vp, tp, dp):
    layout = (
        f"--pipeline-model-parallel-size {pp} --virtual-pipeline-model-parallel-size {vp} "
        f"--tensor-model-parallel-size {tp} --nproc-per-node {pp * tp * dp}"
    ).split()
    losses = _losses(tmp_path, layout)
    assert sorted(losses) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert abs(losses[it] - reference[it]) <= 5e-4 * reference[it], (it, losses[it], reference[it])


@pytest.mark.world
def test_interleaved_resume_is_bitwise_identical(tmp_path):
    args = [
        *EIGHT_LAYERS,
        *"--train-iters 6 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2".split(),
    ]
    straight = run_pretrain(args, tmp_path)
    assert straight.returncode == 0, straight.stderr
    first = run_pretrain([*args, "--save", "c", "--exit-interval", "3"], tmp_path)
    assert first.returncode == 0, first.stderr
    shard = torch.load(
        tmp_path / "c" / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False
    )
    assert "model0" in shard and "model1" in shard and "model" not in shard  # upstream's keys
    resumed = run_pretrain([*args, "--load", "c"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert {it: loss_lines(straight.stdout)[it] for it in range(4, 7)} == loss_lines(resumed.stdout)


PP, VP, MICROBATCHES = 4, 2, 16
MEMORY_MODEL = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    f"--vocab-size 32 --micro-batch-size 2 --global-batch-size {2 * MICROBATCHES} --train-iters 1 "
    f"--pipeline-model-parallel-size {PP} --log-memory-to-tensorboard --log-memory-per-pp-stage"
).split()


def _stage_peaks(tmp_path, name, extra) -> list[float]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    result = run_pretrain([*MEMORY_MODEL, *extra, "--tensorboard-dir", "tb"], run_dir)
    assert result.returncode == 0, result.stderr
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tag = "memory/pp-stage-{}/mem-max-activation-gigabytes"
    return [acc.Scalars(tag.format(stage))[-1].value * 1024**3 for stage in range(PP)]


@pytest.mark.world
def test_stage_peaks_are_what_the_schedule_keeps_in_flight(tmp_path):
    """(pp, vp) = (4, 2), one layer per chunk: rank r's peak, in units of one layer-microbatch, is the
    schedule's largest number of microbatch-chunks in flight, (pp - r - 1) 2 + (vp - 1) pp + 1 =
    11, 9, 7, 5; and the first stage's peak over plain 1F1B's (pp microbatches of two layers) is
    Megatron's interleaving factor 1 + (pp - 1) / (pp vp) = 1.375. The unit, one microbatch-chunk's
    saved bytes, is measured on plain 1F1B's stage 1, which keeps pp - 1 = 3 microbatches of its two
    layers (six chunk-microbatches) in flight."""
    plain = _stage_peaks(tmp_path, "vp1", [])
    unit = plain[1] / ((PP - 1) * 2)
    interleaved = _stage_peaks(tmp_path, "vp2", ["--virtual-pipeline-model-parallel-size", str(VP)])
    for rank in range(PP):
        in_flight = max(sum(c) for c in in_flight_microbatch_chunks(MICROBATCHES, VP, PP, rank))
        assert in_flight == (PP - rank - 1) * 2 + (VP - 1) * PP + 1
        assert interleaved[rank] / unit == pytest.approx(in_flight, rel=0.1), (rank, interleaved, plain, unit)
    assert max(interleaved) / max(plain) == pytest.approx(1 + (PP - 1) / (PP * VP), rel=0.1)
