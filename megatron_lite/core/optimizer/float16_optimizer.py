"""megatron-core's ``Float16OptimizerWithFloat16Params`` over a plain torch optimizer: the bf16 / fp16
parameters it was given are swapped for fp32 main copies (their state moved with them), fp32 ones
stay as they are, frozen ones are left alone; its ``sharded_state_dict`` saves each state tensor and
each fp32 main copy sharded as the model parameter it belongs to. megatron_lite's own training
optimizer is ``MegatronOptimizer`` (``optimizer``); this is upstream's class for code written
against it."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

import torch

from megatron_lite.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from megatron_lite.core.optimizer.optimizer_config import OptimizerConfig

_HALF = (torch.float16, torch.bfloat16)


class Float16OptimizerWithFloat16Params:
    """``optimizer`` (a torch optimizer over the model's parameters) with fp32 main copies of its
    half-precision ones. ``grad_scaler`` may be None (bf16); ``init_state_fn(optimizer, config)``
    creates the state before a load."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler,
        init_state_fn: Callable,
    ):
        self.optimizer, self.config = optimizer, config
        self.grad_scaler, self.init_state_fn = grad_scaler, init_state_fn
        self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups = [], [], []
        for group in optimizer.param_groups:
            half, mains, fp32 = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in _HALF:
                    main = param.detach().clone().float()
                    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "shared"):
                        if hasattr(param, attr):
                            setattr(main, attr, getattr(param, attr))
                    group["params"][i] = param.main_param = main
                    if param in optimizer.state:
                        optimizer.state[main] = optimizer.state.pop(param)
                    half.append(param)
                    mains.append(main)
                elif param.dtype == torch.float32:
                    fp32.append(param)
                else:
                    raise TypeError(f"Wrapped parameters must be fp32, fp16 or bf16, got {param.dtype}")
            self.float16_groups.append(half)
            self.fp32_from_float16_groups.append(mains)
            self.fp32_from_fp32_groups.append(fp32)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        state["fp32_from_fp16_params"] = self.fp32_from_float16_groups
        return state

    def _main_to_model(self) -> dict[int, torch.Tensor]:
        return {
            id(main): model
            for models, mains in zip(self.float16_groups, self.fp32_from_float16_groups, strict=True)
            for model, main in zip(models, mains, strict=True)
        }

    def sharded_state_dict(
        self, model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None
    ):
        """The state dict with every per-parameter state tensor (``optimizer.state.<key>.<param>``) and
        fp32 main copy (``optimizer.state.fp32_param.<param>``) sharded as its model parameter; the
        optimizer's per-parameter ``step`` saved once (``common_step``)."""
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state = self.state_dict()
        to_model = self._main_to_model()
        in_order = [
            to_model.get(id(p), p)
            for p in chain.from_iterable(g["params"] for g in self.optimizer.param_groups)
        ]
        sharded_params = get_param_id_to_sharded_param_map(model_sharded_state_dict, in_order)
        # The state ids of the fp32 main copies only (not native fp32 or frozen parameters), per group.
        main_ids = [
            [pid for pid, p in zip(saved["params"], group["params"], strict=True) if id(p) in to_model]
            for saved, group in zip(
                state["optimizer"]["param_groups"], self.optimizer.param_groups, strict=True
            )
        ]
        state["fp32_from_fp16_params"] = [
            [
                make_sharded_optimizer_tensor(sharded_params[pid], main, prefix="optimizer.state.fp32_param")
                for pid, main in zip(ids, mains, strict=True)
            ]
            for mains, ids in zip(state["fp32_from_fp16_params"], main_ids, strict=True)
        ]
        step = _common_step(state["optimizer"])
        optim_state_to_sharding_state(state["optimizer"], sharded_params, exclude_keys=("step",))
        if step is not None:
            state["optimizer"]["state"]["common_step"] = step
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """The torch optimizer's state (its ``common_step`` given back to every parameter) and the fp32
        main copies."""
        optim = state_dict["optimizer"]
        step = optim["state"].pop("common_step", None)
        if step is not None:
            for param_state in optim["state"].values():
                param_state["step"] = step
        self.optimizer.load_state_dict(optim)
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        for mains, saved in zip(
            self.fp32_from_float16_groups, state_dict["fp32_from_fp16_params"], strict=True
        ):
            for main, value in zip(mains, saved, strict=True):
                main.data.copy_(value.data if hasattr(value, "data") else value)

    def reload_model_params(self, state_dict=None) -> None:
        """Copy the fp32 main copies into the half-precision model parameters."""
        with torch.no_grad():
            for models, mains in zip(self.float16_groups, self.fp32_from_float16_groups, strict=True):
                for model, main in zip(models, mains, strict=True):
                    model.copy_(main)


def _common_step(optimizer_state: dict):
    """The one ``step`` every parameter's state holds (None without any); different steps are a
    ValueError (upstream saves one shared step)."""
    steps = [s["step"] for s in optimizer_state["state"].values() if "step" in s]
    if not steps:
        return None
    if any(float(s) != float(steps[0]) for s in steps):
        raise ValueError("parameters have different optimizer steps; one shared step is saved")
    return steps[0]
