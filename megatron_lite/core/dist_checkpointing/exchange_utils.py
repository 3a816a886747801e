"""Sharing the work of a save or a load among the ranks of a group that hold the same shards
(megatron-core's ``dist_checkpointing.exchange_utils``): ``determine_main_replica_uniform_distribution``
gives each shard held by several ranks of the group to one of them, balancing bytes;
``exchange_loaded_tensors_broadcast`` hands each loaded shard from the rank that read it to the others.

The distribution of a group can be kept in this process (``_PG_DIST_CACHE``, by the group's ranks).
Upstream's on-disk cache of it (``pg_cache_path``, ``--ckpt-pg-tensors-cache-path``) is a feature
megatron_lite does not have."""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_lite.core.dist_checkpointing.dict_utils import nested_values
from megatron_lite.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, is_main_replica

ShardId = tuple


class ShardDistribution(NamedTuple):
    """``main_rank_for_shard``: the group rank that saves / loads each shard; ``shards_in_this_group``:
    the shards distributed; ``shard_to_metadata``: a data-less ShardedTensor of each;
    ``all_ranks_for_shard``: the group ranks that hold each."""

    main_rank_for_shard: dict[ShardId, int]
    shards_in_this_group: set[ShardId]
    shard_to_metadata: dict[ShardId, ShardedTensor]
    all_ranks_for_shard: dict[ShardId, list[int]]


# In-process memo of distributions: group ranks -> {ignore_groups: distribution}.
_PG_DIST_CACHE: dict[str, dict[bool, ShardDistribution]] = {}


def shard_id(sh_ten: ShardedTensor) -> ShardId:
    """What makes two ShardedTensors the same piece of the same global tensor."""
    return sh_ten.key, tuple(sh_ten.global_offset), tuple(sh_ten.local_shape)


def _shard_size(sh_ten: ShardedTensor) -> int:
    return sh_ten.dtype.itemsize * int(torch.Size(sh_ten.local_shape).numel())


def distribute_shards_to_ranks(
    shard_to_ranks: dict[ShardId, list[int]],
    shard_to_size: dict[ShardId, int],
    num_ranks: int,
    cross_parallelization_group_loads: set[ShardId] = frozenset(),
) -> dict[ShardId, int]:
    """Each shard to one of the ranks holding it, biggest shards first, each to the holder with the
    fewest bytes so far (ties: the lower rank); deterministic, so every rank computes the same."""
    load = [0] * num_ranks
    chosen = {}
    for sid in sorted(shard_to_ranks, key=lambda s: (-shard_to_size[s], repr(s))):
        rank = min(shard_to_ranks[sid], key=lambda r: (load[r], r))
        chosen[sid] = rank
        load[rank] += shard_to_size[sid]
    return chosen


def _group_key(group) -> str:
    return ",".join(map(str, dist.get_process_group_ranks(group or dist.group.WORLD)))


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group,
    ignore_groups: bool = False,
    pg_cache_path: str | None = None,
    pg_cache_create: bool = False,
) -> ShardDistribution | None:
    """The distribution of this group's shards (collective over ``parallelization_group``). A save
    (``ignore_groups`` False) distributes only the shards some rank of the group holds as main
    replica; a load every shard. None for a group of one."""
    if pg_cache_path is not None or pg_cache_create:
        raise NotImplementedError(
            "the on-disk PG-distribution cache (--ckpt-pg-tensors-cache-path) is not supported by megatron_lite"
        )
    group = parallelization_group or dist.group.WORLD
    size = dist.get_world_size(group)
    if size <= 1:
        return None
    local = [t.without_data() for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
    everyone: list = [None] * size
    dist.all_gather_object(everyone, local, group=group)
    ranks, sizes, metadata, main = defaultdict(list), {}, {}, set()
    for rank, shards in enumerate(everyone):
        for t in shards:
            sid = shard_id(t)
            if rank not in ranks[sid]:
                ranks[sid].append(rank)
            sizes.setdefault(sid, _shard_size(t))
            metadata.setdefault(sid, t)
            if is_main_replica(t.replica_id):
                main.add(sid)
    chosen = set(ranks) if ignore_groups else main
    ranks = {s: r for s, r in ranks.items() if s in chosen}
    return ShardDistribution(distribute_shards_to_ranks(ranks, sizes, size), chosen, metadata, ranks)


def cached_distribution(sharded_state_dict, group, ignore_groups: bool, use_cache: bool):
    """``determine_main_replica_uniform_distribution``, memoised per group when ``use_cache``."""
    if not use_cache:
        return determine_main_replica_uniform_distribution(sharded_state_dict, group, ignore_groups)
    memo = _PG_DIST_CACHE.setdefault(_group_key(group), {})
    if ignore_groups not in memo:
        memo[ignore_groups] = determine_main_replica_uniform_distribution(
            sharded_state_dict, group, ignore_groups
        )
    return memo[ignore_groups]


def exchange_loaded_tensors_broadcast(
    loaded_tensors: dict[ShardId, torch.Tensor],
    unloaded_shards: dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group=None,
) -> dict[ShardId, torch.Tensor]:
    """Every shard of the distribution broadcast from the rank that loaded it to the group; returns
    ``loaded_tensors`` completed with the shards this rank needs (``unloaded_shards``). Collective."""
    group = parallelization_group or dist.group.WORLD
    me = dist.get_rank(group)
    out = dict(loaded_tensors)
    for sid in sorted(shard_distribution.main_rank_for_shard, key=repr):
        owner = shard_distribution.main_rank_for_shard[sid]
        if owner == me:
            tensor = loaded_tensors[sid].contiguous()
        else:
            meta = shard_distribution.shard_to_metadata[sid]
            tensor = torch.empty(meta.local_shape, dtype=meta.dtype)
        dist.broadcast(tensor, dist.get_global_rank(group, owner), group=group)
        if sid in unloaded_shards:
            out[sid] = tensor
    return out
