"""Megatron-LM's non-distributed optimizer state (megatron-core's ``FP32Optimizer`` and
``Float16OptimizerWithFloat16Params`` around torch's Adam), in both checkpoint formats, as ours.

``torch_dist``: the tensors are ours key for key (``optimizer.state.exp_avg.<key>``, ``.exp_avg_sq.``,
and ``.fp32_param.`` where the weights are bf16 / fp16: megatron-core's ``optim_state_to_sharding_state``);
the common part is torch's param groups and ``state.common_step`` (wrapped in ``optimizer`` for mixed
precision), which ``common_state`` becomes ours.

``torch``: torch's own state dict, its parameters numbered in the order of megatron-core's param
groups (``_get_param_groups``: the model's parameters in ``named_parameters`` order, grouped by
weight-decay multiplier and expert parallelism, the weight-decayed groups first; no weight decay for
biases and 1-D parameters), with the fp32 main weights of a mixed-precision run in
``fp32_from_fp16_params`` (one list per group).

``by_name`` rebuilds that numbering from the shard's model state dict and gives each parameter's
state under its name; the saved groups' sizes must agree with it, or the state is refused.

The step: per parameter for torch's Adam (``state.common_step`` in ``torch_dist``), per param group
for Transformer Engine's and Apex's FusedAdam, which Megatron-LM uses where it is installed.

The distributed optimizer's ``torch_dist`` state in model space (megatron-core's
``fully_sharded_model_space``, the ``fully_reshardable`` Megatron-LM saves with
``--dist-ckpt-optim-fully-reshardable``) is the same tensors, its common part the inner optimizer's
param groups (the step in each). Its bucket-space layouts (``distrib_optim.pt``, ``dp_reshardable``,
Megatron-LM's default) are laid out by megatron-core's gradient buffers, which Megatron-LM itself
reads only at the saved tp / pp: refused, with the reason.
"""

from __future__ import annotations

import torch

from megatron_lite.core.optimizer.sharded_state import DISTRIBUTED_FP32_PARAM, FP32_PARAM

# A torch param group's hyper-parameters that ours has too (Megatron-LM's groups add its own keys).
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "wd_mult", "lr_mult")


def _step(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value or 0)


def _unwrapped(saved: dict) -> tuple[dict | None, bool]:
    """(torch's optimizer state dict, whether mixed precision wrapped it) of a saved optimizer dict."""
    mixed = "param_groups" not in saved and isinstance(saved.get("optimizer"), dict)
    inner = saved.get("optimizer") if mixed else saved
    ok = isinstance(inner, dict) and isinstance(inner.get("param_groups"), list)
    return (inner if ok else None), mixed


def _group_step(groups: list) -> float:
    """FusedAdam's step, kept in each param group (0 for torch's Adam, which keeps it per parameter)."""
    return max((_step(g.get("step", 0)) for g in groups if isinstance(g, dict)), default=0.0)


# megatron-core's distributed optimizer in model space (``torch_dist``): the sharding types whose
# tensors are laid out like the parameters, and the name each gives the fp32 main weights.
MODEL_SPACE = {"fully_sharded_model_space": FP32_PARAM, "fully_reshardable": DISTRIBUTED_FP32_PARAM}


def common(saved) -> tuple[dict | None, str | None]:
    """A ``torch_dist`` common state's optimizer part as ours (``common_state``'s form, ``fp32_param``
    saying whether fp32 main weights are saved, ``fp32_param_prefix`` under which name): ``(state,
    None)``, or ``(None, why not)``. A chained optimizer (a MoE model's dense and expert ones, keyed
    0, 1, ...) is its parts' groups together."""
    saved = saved if isinstance(saved, dict) else {}
    if saved and all(isinstance(k, int) for k in saved):
        parts = [common(saved[k]) for k in sorted(saved)]
        reason = next((why for _, why in parts if why), None)
        if reason:
            return None, reason
        states = [state for state, _ in parts]
        if len({(s["fp32_param"], s["fp32_param_prefix"]) for s in states}) > 1:
            return None, "its chained optimizers keep their fp32 main weights differently"
        return states[0] | {
            "param_groups": [g for s in states for g in s["param_groups"]],
            "step": max(s["step"] for s in states),
        }, None
    sharding = saved.get("param_state_sharding_type")
    if sharding is not None and sharding not in MODEL_SPACE:
        return None, (
            f"its distributed optimizer's state is in Megatron-LM's {sharding!r} format, laid out by "
            "megatron-core's gradient buffers (Megatron-LM's --dist-ckpt-optim-fully-reshardable saves "
            "one that is read)"
        )
    inner, mixed = _unwrapped(saved) if sharding is None else (saved.get("optimizer"), True)
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        return None, "it holds no optimizer state"
    step = _step((inner.get("state") or {}).get("common_step", 0)) or _group_step(inner["param_groups"])
    groups = [{k: g[k] for k in GROUP_KEYS if k in g} for g in inner["param_groups"]]
    return {
        "param_groups": groups,
        "step": step,
        "use_distributed_optimizer": sharding is not None,
        # The distributed optimizer always keeps fp32 main weights, fp32 weights too.
        "fp32_param": mixed,
        "fp32_param_prefix": MODEL_SPACE.get(sharding, FP32_PARAM),
    }, None


def _megatron_core_groups(model_state: dict) -> list[list[str]]:
    """megatron-core's param groups of the parameters a model state dict holds, as names: keyed by
    (no weight decay, expert) in the order first met, then sorted (stably) weight-decayed first, as
    ``_get_param_groups`` sorts by its override (None before the no-weight-decay one)."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in model_state.items():
        no_wd = name.endswith(".bias") or tensor.ndim == 1
        groups.setdefault((no_wd, ".experts." in name), []).append(name)
    return [names for (_, _), names in sorted(groups.items(), key=lambda item: item[0][0])]


def by_name(saved, model_state: dict) -> tuple[dict | None, str | None]:
    """A ``torch``-format shard's optimizer state as ``{"state": {name: {exp_avg, exp_avg_sq, fp32_param?}},
    "step", "param_groups"}`` (the groups' hyper-parameters by weight-decay multiplier), given the shard's
    model state dict in our names; or ``(None, why not)``. A MoE model's chained optimizer (a list:
    megatron-core's optimizer of the dense parameters, then the experts') numbers each part's own."""
    if isinstance(saved, list):
        return _chained(saved, model_state)
    if not isinstance(saved, dict):
        return None, "it holds no optimizer state"
    inner, mixed = _unwrapped(saved)
    if inner is None or not isinstance(inner.get("state"), dict):
        return (
            None,
            "it holds no optimizer state of its own (a distributed optimizer's is in distrib_optim.pt)",
        )
    names = _megatron_core_groups(model_state)
    try:
        return _by_name(inner, saved.get("fp32_from_fp16_params") if mixed else None, names), None
    except _Mismatch as err:
        return None, str(err)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        return None, f"its optimizer state has an unexpected shape ({type(err).__name__})"


def _chained(parts: list, model_state: dict) -> tuple[dict | None, str | None]:
    expert = {k: v for k, v in model_state.items() if ".experts." in k}
    models = [m for m in ({k: v for k, v in model_state.items() if k not in expert}, expert) if m]
    if len(parts) != len(models):
        return (
            None,
            f"its chained optimizer has {len(parts)} parts, not one per dense / expert part ({len(models)})",
        )
    out = {"state": {}, "step": 0.0, "param_groups": []}
    for part, model in zip(parts, models):
        state, reason = by_name(part, model)
        if reason:
            return None, reason
        out["state"] |= state["state"]
        out["step"] = max(out["step"], state["step"])
        out["param_groups"] += state["param_groups"]
    return out, None


class _Mismatch(Exception):
    pass


def _by_name(inner: dict, masters, names: list[list[str]]) -> dict:
    sizes = [len(g["params"]) for g in inner["param_groups"]]
    if sizes != [len(g) for g in names]:
        raise _Mismatch(
            f"its param groups hold {sizes} parameters, not megatron-core's grouping of this model's "
            f"{[len(g) for g in names]}"
        )
    if masters is not None and [len(m) for m in masters] != sizes:
        raise _Mismatch("its fp32 main weights do not cover every parameter of its groups")
    state = {}
    step = _group_step(inner["param_groups"])
    for group_index, (group, group_names) in enumerate(zip(inner["param_groups"], names)):
        for position, (param_id, name) in enumerate(zip(group["params"], group_names)):
            saved = inner["state"].get(param_id, {})
            step = max(step, _step(saved.get("step", 0)))
            entry = {k: v for k, v in saved.items() if k in ("exp_avg", "exp_avg_sq")}
            if masters is not None:
                entry["fp32_param"] = masters[group_index][position]
            state[name] = entry
    groups = [{k: g[k] for k in GROUP_KEYS if k in g} for g in inner["param_groups"]]
    return {"state": state, "step": step, "param_groups": groups}


def apply_by_name(optimizer, model_chunks, saved: dict) -> None:
    """``by_name``'s state into our optimizer (one not distributed; its fp32 main weights already
    copied from the loaded weights): each parameter's moments and step, its fp32 main weight where
    both keep one, the groups' hyper-parameters by weight-decay multiplier. KeyError naming a
    parameter the state does not hold."""
    names = {}
    for chunk in model_chunks:
        names |= {id(p): n.removeprefix("module.") for n, p in chunk.named_parameters()}
    step = torch.tensor(saved["step"], dtype=torch.float32)
    for unit in optimizer.units:
        entry = saved["state"][names[id(unit.param)]]
        state = optimizer.optimizer.state[unit.main]
        state.update(
            {k: v.to(unit.main.dtype) for k, v in entry.items() if k != "fp32_param"}, step=step.clone()
        )
        if "fp32_param" in entry and unit.main is not unit.param:
            unit.main.data.copy_(entry["fp32_param"])
    by_wd = {g.get("wd_mult"): g for g in saved["param_groups"]}
    for group in optimizer.optimizer.param_groups:
        group.update({k: v for k, v in by_wd.get(group.get("wd_mult"), {}).items() if k in group})


def chained_keys(pieces: list, saved_keys) -> None:
    """Older Megatron-LM prefixes a chained optimizer's tensors with its part's index
    (``chained_1.optimizer.state.exp_avg.<key>``; since megatron-core 0.13 only its bucket-space
    layouts do): a piece the checkpoint lacks under its own key reads the one prefixed, in place."""
    prefixed = {}
    for key in saved_keys:
        part, dot, rest = key.partition(".")
        if dot and part.startswith("chained_") and part[len("chained_") :].isdigit():
            prefixed.setdefault(rest, key)
    saved = set(saved_keys)
    for piece in pieces:
        if piece.key.startswith("optimizer.") and piece.key not in saved:
            piece.key = prefixed.get(piece.key, piece.key)
