"""Picking and renaming the sharded values of a nested state dict (megatron-core's
``dist_checkpointing.utils``): each ``extract_*`` splits a state dict into the values of one kind and
the rest, both nested as the original; the prefix functions rename the global keys in place."""

from __future__ import annotations

from megatron_lite.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
from megatron_lite.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

_RENAMEABLE = (ShardedTensor, ShardedTensorFactory, ShardedObject)


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors and ShardedTensorFactories, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """(every ShardedBase value, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """(the LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every ShardedBase value, in place."""

    def add(x):
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add, sharded_state_dict)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in every sharded key, in place; a key without it is a
    ValueError."""

    def replace(x):
        if isinstance(x, _RENAMEABLE):
            if not x.key.startswith(old_prefix):
                raise ValueError(f"Expected {x.key} to begin with prefix {old_prefix}")
            x.key = new_prefix + x.key[len(old_prefix) :]
        return x

    dict_list_map_inplace(replace, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: dict[str, str]) -> None:
    """Rename, in place, the sharded keys that start with one of ``prefix_map``'s old prefixes (the
    first that matches); the others stay."""

    def replace(x):
        if isinstance(x, _RENAMEABLE):
            old = next((p for p in prefix_map if x.key.startswith(p)), None)
            if old is not None:
                x.key = prefix_map[old] + x.key[len(old) :]
        return x

    dict_list_map_inplace(replace, sharded_state_dict)
