"""Where this rank sits in a pipeline, asked of an explicit process group (as in Megatron core).

The ``vp`` helpers answer for a virtual-pipeline chunk. Interleaving is not implemented yet, so
with no virtual pipeline (``vp_size`` None or 1) the only valid chunk is 0 (or None), which is
both the first and the last.
"""

from __future__ import annotations

import torch.distributed as dist


def _rank(group) -> int:
    return group.rank() if hasattr(group, "rank") else dist.get_rank(group)


def _size(group) -> int:
    return group.size() if hasattr(group, "size") else dist.get_world_size(group)


def is_pp_first_stage(pp_group) -> bool:
    """Whether this rank is stage 0 of ``pp_group``."""
    return _rank(pp_group) == 0


def is_pp_last_stage(pp_group) -> bool:
    """Whether this rank is the last stage of ``pp_group``."""
    return _rank(pp_group) == _size(pp_group) - 1


def _check_vp_stage(vp_stage, vp_size) -> bool:
    """True when there is no virtual pipeline; refuses a chunk index that cannot exist then."""
    if vp_size is None or vp_size <= 1:
        assert vp_stage in (None, 0), (
            f"vp_stage must be None or 0 without a virtual pipeline, got vp_stage={vp_stage}, vp_size={vp_size}"
        )
        return True
    return False


def is_vp_first_stage(vp_stage, vp_size) -> bool:
    """Whether chunk ``vp_stage`` is the first of ``vp_size`` virtual stages."""
    return _check_vp_stage(vp_stage, vp_size) or vp_stage == 0


def is_vp_last_stage(vp_stage, vp_size) -> bool:
    """Whether chunk ``vp_stage`` is the last of ``vp_size`` virtual stages."""
    return _check_vp_stage(vp_stage, vp_size) or vp_stage == vp_size - 1


def get_pp_first_rank(pp_group) -> int:
    """Global rank of the first stage of ``pp_group``."""
    return dist.get_process_group_ranks(pp_group)[0]


def get_pp_last_rank(pp_group) -> int:
    """Global rank of the last stage of ``pp_group``."""
    return dist.get_process_group_ranks(pp_group)[-1]


def get_pp_next_rank(pp_group) -> int | None:
    """Global rank of the next stage, None on the last stage."""
    if is_pp_last_stage(pp_group):
        return None
    return dist.get_process_group_ranks(pp_group)[_rank(pp_group) + 1]


def get_pp_prev_rank(pp_group) -> int | None:
    """Global rank of the previous stage, None on the first stage."""
    if is_pp_first_stage(pp_group):
        return None
    return dist.get_process_group_ranks(pp_group)[_rank(pp_group) - 1]
