"""Sharding a plain optimizer's state like the model parameters it belongs to (megatron-core's
``dist_checkpointing.optimizer``): each state tensor (Adam's ``exp_avg`` ...) becomes a copy of its
parameter's ShardedTensor (or factory) keyed ``optimizer.state.<state key>.<parameter key>``."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from copy import deepcopy
from dataclasses import replace

import torch

from megatron_lite.core.dist_checkpointing.dict_utils import nested_values
from megatron_lite.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from megatron_lite.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

logger = logging.getLogger(__name__)


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.Tensor]) -> dict[int, int]:
    """``{id(parameter): its index in the optimizer's order}`` (the first index of a repeated one)."""
    ids: dict[int, int] = {}
    for i, param in enumerate(optim_params_iter):
        ids.setdefault(id(param), i)
    return ids


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.Tensor]
) -> dict[int, ShardedTensor | ShardedTensorFactory]:
    """``{optimizer state id: the model's ShardedTensor or factory of that parameter}``; a value is
    found by its ``data`` being the very parameter the optimizer holds (a state dict made with
    ``keep_vars=True``). ``optim_params_iter``: the optimizer's parameters, in its order."""
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    ids = get_optim_param_to_id_map(optim_params_iter)
    found = {ids[id(t.data)]: t for t in nested_values(sharded) if id(t.data) in ids}
    if not found:
        logger.warning(
            "Sharded parameters mapping is empty: the model state dict's tensors are not the "
            "optimizer's parameters (make the state dict with keep_vars=True)."
        )
    return found


def make_sharded_optimizer_tensor(
    model_param: ShardedTensor | ShardedTensorFactory, optim_param: torch.Tensor, prefix: str
) -> ShardedTensor | ShardedTensorFactory:
    """``model_param`` holding ``optim_param`` instead, its key prefixed with ``prefix.``."""
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=f"{prefix}.{model_param.key}", data=optim_param)
    assert tuple(optim_param.shape) == tuple(model_param.local_shape), (
        f"Optimizer shape ({tuple(optim_param.shape)}) does not match model shape ({model_param.local_shape})"
    )
    return replace(model_param, key=f"{prefix}.{model_param.key}", data=optim_param, dtype=optim_param.dtype)


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: dict[int, ShardedTensor | ShardedTensorFactory],
    exclude_keys: tuple[str, ...] = (),
) -> None:
    """Turn a torch optimizer's ``state_dict()`` into a sharded one, in place: every per-parameter state
    tensor (but ``exclude_keys``) sharded as its parameter, each group's ``params`` kept local (not
    saved, restored from this optimizer on load). A state id without a parameter is a ValueError."""
    sharded_state = {}
    for param_id, param_state in optim_state_dict["state"].items():
        kept = {k: v for k, v in param_state.items() if k not in exclude_keys}
        if kept and param_id not in id_to_sharded_param_map:
            raise ValueError(f"Param id {param_id} does not match any model sharded param")
        sharded_state[param_id] = {
            key: make_sharded_optimizer_tensor(
                id_to_sharded_param_map[param_id], value, prefix=f"optimizer.state.{key}"
            )
            for key, value in kept.items()
        }
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded_state
