"""The order a pipeline rank runs its forwards and backwards in (Megatron's 1F1B and interleaved
schedules): how many warmup forwards, the virtual-microbatch table, the whole order as events, and
what it keeps in flight. The schedules run it; the memory prediction and the dry run read it here.

Rank ``r`` of ``pp`` runs ``pp - r - 1`` warmup forwards under plain 1F1B, ``(pp - r - 1) * 2 +
(vp - 1) * group`` with ``vp`` model chunks (capped at the total), then alternates one forward with one
backward, then drains the backwards. Interleaved work goes by virtual microbatches: upstream's table
takes groups of ``microbatch_group_size_per_vp_stage`` (default pp) microbatches through every chunk in
turn.
"""

from __future__ import annotations


def get_pp_rank_microbatches(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int, pp_size: int,
    pp_rank: int, forward_only: bool = False,
) -> tuple[int, bool, int, int]:  # fmt: skip
    """(total virtual microbatches, whether all are warmup, warmup count, remaining count)."""
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    else:
        warmup = (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
    all_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_warmup, warmup, total - warmup


def one_f_one_b_warmup(num_microbatches: int, pp_size: int, pp_rank: int) -> int:
    """Plain 1F1B's warmup forwards on ``pp_rank``: one per later stage, at most all microbatches."""
    return min(pp_size - pp_rank - 1, num_microbatches)


def get_schedule_table(num_microbatches: int, num_model_chunks: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of every virtual microbatch in forward order: each group of ``group``
    microbatches through chunk 0, then chunk 1, ...; the last group takes whatever remains."""
    table = []
    for start in range(0, num_microbatches, group):
        end = num_microbatches if start + group >= num_microbatches else start + group
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(start, end))
    return table


def forward_backward_order(
    num_microbatches: int, num_model_chunks: int, pp_size: int, pp_rank: int, group: int | None = None
) -> list[tuple[str, int]]:
    """The forwards and backwards rank ``pp_rank`` runs in a training step, in order, as ("F" | "B",
    model chunk): the warmup forwards, then one forward and one backward at a time, then the remaining
    backwards. Plain 1F1B when ``num_model_chunks`` is 1 (``pp - r - 1`` warmup forwards), else the
    interleaved schedule's order over ``get_schedule_table`` (a backward runs its chunks last first).
    The one account of the order that the schedules' step counts, the memory prediction and the dry
    run's microbatch count all read."""
    group = group or pp_size
    total, _, warmup, remaining = get_pp_rank_microbatches(
        num_microbatches, num_model_chunks, group, pp_size, pp_rank
    )
    if num_model_chunks == 1:
        warmup = one_f_one_b_warmup(num_microbatches, pp_size, pp_rank)
        remaining = num_microbatches - warmup
    table = get_schedule_table(num_microbatches, num_model_chunks, group)
    last = num_model_chunks - 1
    order = [("F", table[k][1]) for k in range(warmup)]
    for k in range(warmup, warmup + remaining):
        order += [("F", table[k][1]), ("B", last - table[k - warmup][1])]
    return order + [("B", last - table[k][1]) for k in range(remaining, total)]


def in_flight_microbatch_chunks(
    num_microbatches: int, num_model_chunks: int, pp_size: int, pp_rank: int, group: int | None = None
) -> list[list[int]]:
    """For each forward this rank runs, how many microbatches of each chunk hold activations right after
    it (forwards done minus backwards done, per chunk), following :func:`forward_backward_order`: the
    schedule's own account of what a rank keeps in flight (``vp = 1`` gives plain 1F1B's ``pp - r``)."""
    counts, timeline = [0] * num_model_chunks, []
    for kind, chunk in forward_backward_order(num_microbatches, num_model_chunks, pp_size, pp_rank, group):
        counts[chunk] += 1 if kind == "F" else -1
        if kind == "F":
            timeline.append(list(counts))
    return timeline


def check_interleaving(num_microbatches: int, pp_size: int, group: int) -> None:
    """Upstream's conditions on the microbatch count; ValueError otherwise."""
    if not pp_size <= group <= num_microbatches:
        raise ValueError(
            f"microbatches per virtual-stage group ({group}) must be between the pipeline size "
            f"({pp_size}) and the number of microbatches ({num_microbatches})"
        )
    remainder = num_microbatches % group
    if 0 < remainder < pp_size:
        raise ValueError(
            f"{num_microbatches} microbatches leave a last group of {remainder}, fewer than the "
            f"pipeline size {pp_size} (a bubble the schedule cannot fill)"
        )
