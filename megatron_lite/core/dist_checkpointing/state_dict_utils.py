"""Splitting a state dict before a save or a load (megatron-core's ``dist_checkpointing``
``state_dict_utils``): factories built, the sharded values (``ShardedBase``) apart from the common
ones, which rank 0 saves whole."""

from __future__ import annotations

import copy
from collections.abc import Callable

from megatron_lite.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
from megatron_lite.core.dist_checkpointing.mapping import (
    CommonStateDict,
    LocalNonpersistentObject,
    ShardedBase,
    ShardedStateDict,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
)
from megatron_lite.core.dist_checkpointing.validation import (
    determine_global_metadata,
    validate_sharding_integrity,
)


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """(the ShardedBase values, everything else), each nested as in ``sharded_state_dict``."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict] | None = None,
) -> tuple[ShardedStateDict, StateDict]:
    """Build the factories (in place) and split off the common part. With
    ``validate_access_integrity``, check that every rank's pieces save each value once and log where a
    rank's common part differs from rank 0's (after ``preprocess_common_before_consistancy_check``,
    given a copy). Collective then."""
    apply_factories(sharded_state_dict)
    _, sharded_state_dict = _extract_nonpersistent(sharded_state_dict)  # never saved
    sharded_part, common = extract_sharded_base(sharded_state_dict)
    if validate_access_integrity:
        checked = common
        if preprocess_common_before_consistancy_check is not None:
            checked = preprocess_common_before_consistancy_check(copy.deepcopy(common))
        _, global_metadata = determine_global_metadata(sharded_part)
        validate_sharding_integrity(global_metadata, checked)
    return sharded_part, common


def _extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> tuple[StateDict, StateDict]:
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def load_preprocess(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict, StateDict]:
    """(the request with its factories built and without its non-persistent values, those values
    unwrapped (put back as this rank has them), its factories, lists as dicts by index: what
    ``apply_factory_merges`` puts back after the load)."""
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)
    nonpersistent, sharded_state_dict = _extract_nonpersistent(sharded_state_dict)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    return sharded_state_dict, nonpersistent, factories
