"""Reduce the loss reports of a step's microbatches over data-parallel ranks, both of upstream's forms.

A loss function reports each key either as a scalar (legacy: the microbatch's mean, averaged over
microbatches and then ranks) or as ``[sum, num_tokens]`` (averaged over every token of the global
batch). Both are kept as a ``(numerator, denominator)`` pair, so one all-reduce sums them all:
a scalar contributes ``(mean, 1)``, a pair contributes itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.utils import get_collective_device


def accumulate_loss_reports(totals: dict[str, torch.Tensor], reports: list[dict]) -> dict[str, torch.Tensor]:
    """Add one global batch's per-microbatch reports to ``totals`` (key -> float64 ``[num, den]``);
    returns ``totals``. Local: no collective."""
    for key in reports[0] if reports else ():
        values = [r[key].detach().reshape(-1).double() for r in reports]
        if values[0].numel() == 2:
            pair = torch.stack(values).sum(dim=0)
        elif values[0].numel() == 1:
            pair = torch.stack([torch.cat(values).mean(), torch.ones((), dtype=torch.float64)])
        else:
            raise ValueError(
                f"a loss report is a scalar or [sum, num_tokens]; {key!r} has {values[0].numel()}"
            )
        totals[key] = totals[key] + pair.cpu() if key in totals else pair.cpu()
    return totals


def reduce_loss_reports(totals: dict[str, torch.Tensor], dp_cp_group) -> dict[str, torch.Tensor]:
    """Each key's ``num / den`` after summing the pairs over ``dp_cp_group`` in one all-reduce.
    Collective over ``dp_cp_group`` on the ranks that hold losses (all of that group, or none)."""
    if not totals:
        return {}
    keys = list(totals)
    pairs = torch.stack([totals[k] for k in keys])
    if dist.is_initialized() and dist.get_world_size(dp_cp_group) > 1:
        pairs = pairs.to(get_collective_device(dp_cp_group))
        dist.all_reduce(pairs, group=dp_cp_group)
    means = (pairs[:, 0] / pairs[:, 1]).float().cpu()
    return dict(zip(keys, means.unbind()))
