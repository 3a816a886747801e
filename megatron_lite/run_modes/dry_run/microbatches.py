"""How many microbatches a stage's dry run drives, and which stages are twins: the schedule's own counts."""

from __future__ import annotations

import copy


def most_in_flight(config, count: int) -> list[tuple[int, ...]]:
    """Per stage, per model chunk: the most microbatches holding activations at once over ``count``
    microbatches (the schedule's own count, ``in_flight_microbatch_chunks``)."""
    from megatron_lite.core.pipeline_parallel.schedule_order import in_flight_microbatch_chunks

    m = config.model
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    group = m.microbatch_group_size_per_vp_stage or pp
    timelines = [in_flight_microbatch_chunks(count, vp, pp, rank, group) for rank in range(pp)]
    return [tuple(max((step[c] for step in t), default=0) for c in range(vp)) for t in timelines]


def stage_signature(config, rank: int, in_flight: tuple[int, ...]) -> tuple:
    """What decides a stage's memory: its chunks' layer counts and ends, and microbatches in flight."""
    from megatron_lite.core.transformer.transformer_block import get_num_layers_to_build
    from megatron_lite.training.memory.predict.params import chunk_bounds

    m = config.model
    chunks = tuple(
        (get_num_layers_to_build(m, vp_stage, rank), *chunk_bounds(m, rank, vp_stage))
        for vp_stage in range(m.virtual_pipeline_model_parallel_size or 1)
    )
    return chunks, in_flight


def dry_run_microbatches(config) -> int:
    """Microbatches the dry run drives: the fewest whose schedule holds, on every stage and chunk, as
    many microbatches in flight at once as all of them do (the schedule's own count,
    ``in_flight_microbatch_chunks``) and takes at least one steady-state step; from there on each
    further microbatch repeats the same allocations and frees. All of them under
    --defer-embedding-wgrad-compute, whose buffers grow with every microbatch until the flush."""
    from megatron_lite.core.pipeline_parallel.schedule_order import get_pp_rank_microbatches

    m, total = config.model, config.num_microbatches
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    group = m.microbatch_group_size_per_vp_stage or pp
    if m.defer_embedding_wgrad_compute or pp == 1:
        return total if m.defer_embedding_wgrad_compute else min(total, 2)

    target = most_in_flight(config, total)
    if vp == 1:  # plain 1F1B: stage 0's pp - 1 warmup forwards, then its first steady step
        counts = range(pp, total)
    else:
        counts = (
            c for c in range(group, total, group) if get_pp_rank_microbatches(c, vp, group, pp, 0)[3] >= 1
        )
    for count in counts:
        if most_in_flight(config, count) == target:
            return count
    return total


def with_microbatches(config, count: int):
    """A shallow copy of ``config`` whose global batch is ``count`` microbatches per DP rank."""
    config, train = copy.copy(config), copy.copy(config.train)
    train.global_batch_size = count * train.micro_batch_size * config.data_parallel_size
    config.train = train
    return config
