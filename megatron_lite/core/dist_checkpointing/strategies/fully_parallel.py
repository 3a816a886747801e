"""megatron-core's fully parallel save and load (``strategies.fully_parallel``): wrappers around a
sharded strategy that share the work among the ranks of a group holding the same shards (the
data-parallel replicas). A save has each shard written by one rank of the group, chosen to balance
bytes, instead of always the first replica; a load has each shard read by one rank, then broadcast
to the others that need it (``exchange_utils``). The checkpoint and the loaded values are the same
as without the wrapper."""

from __future__ import annotations

import torch.distributed as dist

from megatron_lite.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron_lite.core.dist_checkpointing.exchange_utils import (
    cached_distribution,
    exchange_loaded_tensors_broadcast,
    shard_id,
)
from megatron_lite.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)


def _refuse_disk_cache(pg_cache_path, pg_cache_create=False) -> None:
    if pg_cache_path is not None or pg_cache_create:
        raise NotImplementedError(
            "the on-disk PG-distribution cache (--ckpt-pg-tensors-cache-path) is not supported by megatron_lite"
        )


class FullyParallelSaveStrategyWrapper:
    """Saves through ``strategy`` with each shard's main replica moved to the rank of
    ``parallelization_group`` (default: the world) the distribution gives it.
    ``do_cache_distribution``: compute the distribution once per group in this process."""

    def __init__(
        self,
        strategy,
        parallelization_group=None,
        do_cache_distribution: bool = False,
        pg_cache_path: str | None = None,
        pg_cache_create: bool = False,
    ):
        _refuse_disk_cache(pg_cache_path, pg_cache_create)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.backend, self.version = strategy.backend, strategy.version

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Replica id 0 on the shards this rank saves, 1 on the others it holds of the distributed
        shards; the rest untouched. Collective over the group."""
        group = self.parallelization_group or dist.group.WORLD
        distribution = cached_distribution(sharded_state_dict, group, False, self.do_cache_distribution)
        if distribution is None:
            return
        me = dist.get_rank(group)
        for t in nested_values(sharded_state_dict):
            if isinstance(t, ShardedTensor) and shard_id(t) in distribution.shards_in_this_group:
                t.replica_id = 0 if distribution.main_rank_for_shard[shard_id(t)] == me else 1

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> None:
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str):
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)


class FullyParallelLoadStrategyWrapper:
    """Loads through ``strategy``, each tensor shard read by one rank of ``parallelization_group``
    (default: the world) and broadcast to the others holding it. ``exchange_algo``: upstream's
    choice of exchange; megatron_lite broadcasts (its ``'broadcast'``) whatever is asked."""

    def __init__(
        self,
        strategy,
        parallelization_group=None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
        pg_cache_path: str | None = None,
    ):
        _refuse_disk_cache(pg_cache_path)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> StateDict:
        """As the base strategy's load. Collective over the world (the read) and the group (the
        exchange)."""
        group = self.parallelization_group or dist.group.WORLD
        distribution = cached_distribution(sharded_state_dict, group, True, self.do_cache_distribution)
        if distribution is None:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        me = dist.get_rank(group)
        values = list(nested_values(sharded_state_dict))
        tensors = {shard_id(t): t for t in values if isinstance(t, ShardedTensor)}
        mine = [t for sid, t in tensors.items() if distribution.main_rank_for_shard[sid] == me]
        objects = [o for o in values if isinstance(o, ShardedObject)]
        # Copies of the lists: the base strategy replaces their items by the loaded values.
        loaded = self.base_strategy.load({"tensors": list(mine), "objects": list(objects)}, checkpoint_dir)
        by_id = {shard_id(t): data for t, data in zip(mine, loaded["tensors"], strict=True)}
        unloaded = {sid: t for sid, t in tensors.items() if sid not in by_id}
        by_id = exchange_loaded_tensors_broadcast(by_id, unloaded, distribution, group)
        by_object = {id(o): data for o, data in zip(objects, loaded["objects"], strict=True)}

        def value(x):
            if isinstance(x, ShardedTensor):
                return by_id[shard_id(x)]
            return by_object[id(x)] if isinstance(x, ShardedObject) else x

        return dict_list_map_inplace(value, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str, metadata=None):
        return self.base_strategy.load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: str):
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)
