"""The optimizer's part of a ``torch_dist`` checkpoint, in model space (megatron-core's fully
reshardable form): for every parameter, ``optimizer.state.exp_avg.<key>``,
``optimizer.state.exp_avg_sq.<key>`` and, where the weights are kept in lower precision,
``optimizer.state.fp32_param.<key>`` (``optimizer.state.param.<key>`` for every parameter with the
distributed optimizer, as megatron-core's), each laid out like the parameter's own global tensor.

The distributed optimizer's shard of a parameter (a flat range of it) becomes up to three rectangles
per slab of that tensor, so a load may use another data-parallel size, another TP / PP layout, or no
distributed optimizer at all: every rank asks for its own ranges and DCP finds them wherever they
were written. The step count and hyper-parameters are plain values (``common_state``).
"""

from __future__ import annotations

import torch

from megatron_lite.core.dist_checkpointing.mapping import ShardedTensor, flat_range_pieces

MOMENTS = ("exp_avg", "exp_avg_sq")
FP32_PARAM = "optimizer.state.fp32_param."
# megatron-core's DistributedOptimizer saves the fp32 main parameters of every parameter (fp32
# weights' too) and, in its fully reshardable layout (Megatron-LM's --dist-ckpt-optim-fully-reshardable),
# names them so; the moments keep their names.
DISTRIBUTED_FP32_PARAM = "optimizer.state.param."


def _ranges(optimizer):
    """``(param, start, main, is_copy)`` per part this rank updates: ``main`` the fp32 values of the
    flat elements ``[start, start + main.numel())`` of ``param``."""
    return [(u.param, u.start, u.main, u.main is not u.model) for u in optimizer.units]


def _state(optimizer, main: torch.Tensor, step: float) -> dict:
    """AdamW's state for ``main``, created (zero moments) where no step has run yet."""
    state = optimizer.optimizer.state[main]
    for k in MOMENTS:
        if k not in state:
            state[k] = torch.zeros_like(main, memory_format=torch.preserve_format)
    if "step" not in state:
        state["step"] = torch.tensor(float(step), dtype=torch.float32)
    return state


def _step(optimizer) -> float:
    """AdamW's step count (the same for every parameter); 0 before the first step."""
    return next((float(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s), 0.0)


def common_state(optimizer) -> dict:
    """Hyper-parameters per group and the step count: plain values, the same on every rank."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
    return {"param_groups": groups, "step": _step(optimizer)}


def optimizer_pieces(
    optimizer,
    placement: dict,
    *,
    fp32_from: str | None = FP32_PARAM,
    moments: bool = True,
    every_fp32: bool = False,
) -> list[ShardedTensor]:
    """This rank's optimizer tensors as pieces of the global ones. ``placement``:
    ``{param: (slabs, replica_id)}``. ``fp32_from``: the prefix of the fp32 main parameters' tensors
    (``""``: the model's own, for a checkpoint that has none); None leaves them out. ``moments``
    False: the fp32 main parameters only (``--load-main-params-from-ckpt``). ``every_fp32``: those of
    fp32 weights too, which are the weights themselves (the distributed optimizer's save: megatron-core's
    layout of it holds one for every parameter)."""
    step = _step(optimizer)
    pieces = []
    for param, start, main, is_copy in _ranges(optimizer):
        if param not in placement:
            continue
        slabs, replica = placement[param]
        for k in MOMENTS if moments else ():
            flat = _state(optimizer, main, step)[k].view(-1)
            pieces += flat_range_pieces(slabs, param.shape, flat, start, replica, f"optimizer.state.{k}.")
        if (is_copy or every_fp32) and fp32_from is not None:
            pieces += flat_range_pieces(slabs, param.shape, main.detach().view(-1), start, replica, fp32_from)
    return pieces


def load_common_state(optimizer, common: dict) -> None:
    """Hyper-parameters and the step count from ``common_state``, after the tensors were read."""
    # By weight-decay multiplier, not position: an optimizer leaves out a group it has no parameter
    # for, so ranks (and layouts) may hold different numbers of groups.
    # The first group of a multiplier wins (a chained optimizer's dense part before its experts').
    saved_groups = {g.get("wd_mult"): g for g in reversed(common["param_groups"])}
    for group in optimizer.optimizer.param_groups:
        # Only the hyper-parameters this optimizer has (a checkpoint may carry megatron-core's keys too).
        saved = saved_groups.get(group.get("wd_mult"), {})
        group.update({k: v for k, v in saved.items() if k in group and k != "params"})
    for state in optimizer.optimizer.state.values():
        state["step"] = torch.tensor(float(common["step"]), dtype=torch.float32)
