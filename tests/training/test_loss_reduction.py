"""Loss reports reduced over microbatches and data-parallel ranks, in both of upstream's forms."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_world

from megatron_lite.training.utils.loss_reduction import accumulate_loss_reports, reduce_loss_reports


def _reports(rank: int) -> list[dict]:
    # Rank 0: two microbatches of 2 tokens with summed loss 6 and 2; rank 1: one of 4 tokens summing to 4.
    # Token-weighted: (6 + 2 + 4) / (2 + 2 + 4) = 1.5. The scalar key averages per-microbatch means.
    if rank == 0:
        return [
            {"lm loss": torch.tensor([6.0, 2.0]), "z": torch.tensor(1.0)},
            {"lm loss": torch.tensor([2.0, 2.0]), "z": torch.tensor(3.0)},
        ]
    return [{"lm loss": torch.tensor([4.0, 4.0]), "z": torch.tensor(6.0)}]


def _reduce_in_world(rank, world_size):
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        reduced = reduce_loss_reports(accumulate_loss_reports({}, _reports(rank)), dist.group.WORLD)
    finally:
        dist.all_reduce = real_all_reduce
    return {k: v.item() for k, v in reduced.items()}, len(calls)


@pytest.mark.world
def test_pairs_are_token_weighted_and_scalars_rank_averaged_in_one_all_reduce():
    for reduced, calls in run_world(_reduce_in_world, 2):
        assert calls == 1
        assert reduced["lm loss"] == pytest.approx(12.0 / 8.0)  # not the mean of means (2.0)
        assert reduced["z"] == pytest.approx(((1.0 + 3.0) / 2 + 6.0) / 2)


def test_accumulating_several_batches_sums_pairs_and_averages_scalar_means():
    totals = accumulate_loss_reports({}, [{"a": torch.tensor([3.0, 1.0]), "b": torch.tensor(2.0)}])
    accumulate_loss_reports(totals, [{"a": torch.tensor([1.0, 3.0]), "b": torch.tensor(4.0)}])
    reduced = reduce_loss_reports(totals, None)  # no process group: this process alone
    assert reduced["a"].item() == pytest.approx(4.0 / 4.0)
    assert reduced["b"].item() == pytest.approx(3.0)


def test_a_report_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="scalar or \\[sum, num_tokens\\]"):
        accumulate_loss_reports({}, [{"a": torch.tensor([1.0, 2.0, 3.0])}])
