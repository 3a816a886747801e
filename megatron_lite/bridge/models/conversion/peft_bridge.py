"""LoRA adapters out of megatron_lite as a Hugging Face PEFT adapter (Megatron-Bridge's
``models/conversion/peft_bridge.py``: ``MegatronPeftBridge.stream_adapter_weights_megatron_to_hf``,
``build_adapter_config_dict``, ``infer_target_modules_from_adapter_weights``), or folded into the
base weights as they stream out (``MergedLoRAExport``, Bridge's ``merge_adapter_weights``).

An adapter's ``linear_in`` is the ``lora_A`` of every Hugging Face projection its base layer fuses, and
its ``linear_out`` rows split as the base weight's rows do: ``linear_qkv`` into ``q_proj`` / ``k_proj`` /
``v_proj`` per query group, a gated ``linear_fc1`` into ``gate_proj`` / ``up_proj``; an adapter shared
by a grouped expert layer's experts is each expert's. The whole tensors are gathered over TP (expert
TP for experts; each by its own partition dim, a column-parallel base's ``linear_out`` in the base
weight's row order, gated halves included) and broadcast over PP, one adapter at a time, in the same
order on every rank.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from megatron_lite.bridge.models.conversion import experts
from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.conversion.export_gather import (
    WholeTensorExport,
    export_order,
    layer_offset,
    model_groups,
    owners_over_stages,
)
from megatron_lite.bridge.models.conversion.utils import unwrap_model
from megatron_lite.bridge.models.conversion.weight_tuples import HFWeightTuple
from megatron_lite.core.models.gpt.state_dict_sharding import global_name

# Megatron-Bridge's suffix map: the adapter's two linears are PEFT's A and B.
MEGATRON_TO_HF_LORA_SUFFIX = {".linear_in.weight": ".lora_A.weight", ".linear_out.weight": ".lora_B.weight"}
_HF_LORA_SUFFIXES = tuple(MEGATRON_TO_HF_LORA_SUFFIX.values())


def adapter_wrappers(chunk):
    """(whole-model name of the wrapped layer, wrapper) of every LoRA-wrapped layer in a model chunk."""
    offset = layer_offset(chunk)
    for name, module in chunk.named_modules():
        if hasattr(module, "to_wrap") and hasattr(getattr(module, "adapter", None), "linear_in"):
            yield global_name(name + ".weight", offset).removesuffix(".weight"), module


def stage_wrappers(chunks) -> dict:
    """This rank's {whole-model name of a LoRA-wrapped layer: its wrapper}."""
    return {prefix: wrapper for chunk in chunks for prefix, wrapper in adapter_wrappers(chunk)}


def _stage_adapters(chunks) -> dict:
    """This rank's {adapter weight's whole-model name: (param, stage index, chunk)}."""
    entries = {}
    for vp_stage, chunk in enumerate(chunks):
        for prefix, wrapper in adapter_wrappers(chunk):
            for which in ("linear_in", "linear_out"):
                param = getattr(wrapper.adapter, which).weight
                entries.setdefault(f"{prefix}.adapter.{which}.weight", (param, vp_stage, chunk))
    return entries


def _whole(local, owner_stage: int, shape, dtype, merge, group, pp_group, device) -> torch.Tensor:
    """The whole tensor on every rank: gathered over ``group`` on the owning stage (``merge`` of the
    shards in rank order), then broadcast over PP. Collective over both groups."""
    if local is not None and owner_stage == dist.get_rank(pp_group):
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, local.detach().contiguous(), group=group)
        full = merge(shards).contiguous()
        meta = torch.tensor(full.shape, device=device)
    else:
        full, meta = None, torch.zeros(len(shape), dtype=torch.long, device=device)
    if dist.get_world_size(pp_group) > 1:
        src = dist.get_global_rank(pp_group, owner_stage)
        dist.broadcast(meta, src, group=pp_group)
        if full is None:
            full = torch.empty(tuple(meta.tolist()), dtype=dtype, device=device)
        dist.broadcast(full, src, group=pp_group)
    return full


def _merge_by_attributes(param):
    """Concatenate along the parameter's own TP partition dim (megatron's attributes); one copy
    when it is whole on every rank."""
    if param is None or not getattr(param, "tensor_model_parallel", False):
        return lambda shards: shards[0]
    return lambda shards: torch.cat(shards, dim=param.partition_dim)


def _linear_out_merge(base_name: str, param, config):
    """A column-parallel base's ``linear_out`` rows follow the base weight's rows on each rank (a
    gated fc1: each rank's gate rows, then its up rows): merged as the base weight is, expert by
    expert for one stacked per expert ``(experts, out, dim)``."""
    if (
        param is None
        or not getattr(param, "tensor_model_parallel", False)
        or experts.split_dim(base_name) != 0
    ):
        return _merge_by_attributes(param)
    if param.dim() == 3:
        return lambda shards: torch.stack(
            [experts.merge_shards(base_name, [s[i] for s in shards], config) for i in range(param.shape[0])]
        )
    return lambda shards: experts.merge_shards(base_name, shards, config)


def whole_adapter_weight(
    which: str, prefix: str, owners: dict, wrapper, base_name: str, groups, config, device
):
    """The whole ``linear_in`` (A) or ``linear_out`` (B) of the adapter on layer ``prefix``, on every
    rank; B in the base weight's row order. ``wrapper``: the LoRALinear on its owning stage (None
    elsewhere); ``groups``: (tp or expert tp, pp). Collective over both groups."""
    stage, shape, dtype = owners[f"{prefix}.adapter.{which}.weight"]
    param = None if wrapper is None else getattr(wrapper.adapter, which).weight
    merge = (
        _linear_out_merge(base_name, param, config) if which == "linear_out" else _merge_by_attributes(param)
    )
    return _whole(param, stage, shape, dtype, merge, *groups, device)


def _expert_index(name: str) -> int:
    return int(re.search(r"(\d+)$", name).group(1))


class MergedLoRAExport(WholeTensorExport):
    """A LoRA-wrapped layer's weight exported with its adapter folded in (Megatron-Bridge's
    ``merge_adapter_weights``): ``W + alpha / dim * B A`` of the whole tensors, then the base's Hugging
    Face tensors. Collective as WholeTensorExport is, for three tensors; the model is left as it is."""

    def __init__(self, base: WholeTensorExport, prefix: str, owners: dict, wrapper, scale: float):
        groups = (base.tp_group, base.pp_group, base.expt_tp_group)
        owner = (base.stage, base.shape, base.dtype)
        super().__init__(base.mapping, base.name, owner, groups, base.config, base.device)
        self.prefix, self.owners, self.wrapper, self.scale = prefix, owners, wrapper, scale

    def megatron_to_hf(self, megatron_weights, megatron_module) -> dict[str, torch.Tensor]:
        full = self.whole(megatron_weights)
        group = self.expt_tp_group if experts.is_expert_param(self.name) else self.tp_group
        lora_a, lora_b = (
            whole_adapter_weight(
                which,
                self.prefix,
                self.owners,
                self.wrapper,
                self.name,
                (group, self.pp_group),
                self.config,
                self.device,
            )  # fmt: skip
            for which in ("linear_in", "linear_out")
        )
        if lora_a.dim() == 3:  # one adapter per expert, stacked: this weight's expert
            lora_a, lora_b = lora_a[_expert_index(self.name)], lora_b[_expert_index(self.name)]
        merged = (full.float() + self.scale * (lora_b.float() @ lora_a.float())).to(full.dtype)
        return self.mapping.full_to_hf(merged, self.config)


def adapter_scales(chunks, pp_group) -> dict:
    """{whole-model name of a LoRA-wrapped layer: its alpha / dim} over all stages (collective over PP)."""
    mine = {prefix: w.adapter.alpha / w.adapter.dim for prefix, w in stage_wrappers(chunks).items()}
    gathered = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, mine, group=pp_group)
    return {k: v for stage in gathered for k, v in stage.items()}


def lora_hf_name(hf_base_name: str, megatron_suffix: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return hf_base_name.removesuffix(".weight") + MEGATRON_TO_HF_LORA_SUFFIX[megatron_suffix]


def _targets(registry, prefix: str, owners: dict, config) -> list:
    """[(base weight's name, its mapping, index in a stacked per-expert adapter or None)] of the
    adapter on layer ``prefix``: its one weight, or a grouped expert layer's ``weight<e>`` each."""
    mapping = registry.megatron_to_hf_lookup(prefix + ".weight")
    if mapping is not None:
        return [(prefix + ".weight", mapping, None)]
    stacked = len(owners[f"{prefix}.adapter.linear_in.weight"][1]) == 3
    names = [f"{prefix}.weight{e}" for e in range(config.num_moe_experts or 0)]
    found = [(n, registry.megatron_to_hf_lookup(n), e if stacked else None) for e, n in enumerate(names)]
    return found if found and all(m is not None for _, m, _ in found) else []


def _hf_transposes(mapping, lora_b: torch.Tensor, config) -> bool:
    """Whether the base mapping writes its Hugging Face tensor as [in, out] (GPT-2's Conv1D): told
    by a probe one column wider than B, so a square B cannot mislead it."""
    probe = lora_b.new_zeros(lora_b.shape[0], lora_b.shape[1] + 1)
    return next(iter(mapping.full_to_hf(probe, config).values())).shape[-1] != probe.shape[1]


def _stream_adapter_weights(
    bridge, megatron_model, cpu: bool = True, show_progress: bool = False, exclude_adapter_base_prefixes=None
):
    """HFWeightTuple (Hugging Face LoRA name, whole tensor) of every adapter, on every rank, in layer
    order: a layer that fuses several Hugging Face projections gives each its A and its rows of B,
    an expert layer's adapter shared by its experts gives each expert a copy; layers whose whole-model
    name starts with one of ``exclude_adapter_base_prefixes`` are left out. Collective over TP
    (expert TP) and PP: every rank must consume the whole iterator."""
    chunks = unwrap_model(megatron_model if isinstance(megatron_model, list) else [megatron_model])
    config = chunks[0].config
    tp_group, pp_group, expt_tp_group, ep_group = model_groups(chunks[0])
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        raise BridgeError(
            "adapter export at expert_model_parallel_size > 1 is not supported: each rank holds some "
            "experts only; export from the checkpoint at expert parallel size 1"
        )
    registry = bridge.mapping_registry()
    wrappers = stage_wrappers(chunks)
    owners = owners_over_stages(_stage_adapters(chunks), pp_group)
    device = next(chunks[0].parameters()).device
    excluded = tuple(exclude_adapter_base_prefixes or ())
    prefixes = sorted(
        {n.rsplit(".adapter.", 1)[0] for n in owners}, key=lambda p: export_order(p + ".weight")
    )
    main = not dist.is_initialized() or dist.get_rank() == 0
    prefixes = [p for p in prefixes if not (excluded and p.startswith(excluded))]
    for number, prefix in enumerate(prefixes, start=1):
        targets = _targets(registry, prefix, owners, config)
        if not targets:
            raise BridgeError(
                f"{prefix}: a LoRA adapter on this layer has no Hugging Face PEFT target in a "
                f"{bridge.MODEL_TYPE} model"
            )
        base_name = targets[0][0]
        groups = (expt_tp_group if experts.is_expert_param(base_name) else tp_group, pp_group)
        lora_a, lora_b = (
            whole_adapter_weight(
                which, prefix, owners, wrappers.get(prefix), base_name, groups, config, device
            )
            for which in ("linear_in", "linear_out")
        )
        for _, mapping, index in targets:
            a, b = (lora_a, lora_b) if index is None else (lora_a[index], lora_b[index])
            transposed = _hf_transposes(mapping, b, config)
            for hf_base, b_rows in mapping.full_to_hf(b, config).items():
                b_rows = b_rows.t() if transposed else b_rows  # PEFT keeps B as a Linear's (out, r)
                for hf_name, tensor in (
                    (lora_hf_name(hf_base, ".linear_in.weight"), a),
                    (lora_hf_name(hf_base, ".linear_out.weight"), b_rows),
                ):
                    tensor = tensor.detach()
                    yield HFWeightTuple(hf_name, tensor.cpu() if cpu else tensor)
        if show_progress and main:
            print(f" adapter: {prefix} ({number}/{len(prefixes)})", flush=True)


class MegatronPeftBridge:
    """Mixed into MegatronModelBridge (Megatron-Bridge's adapter-aware helpers, by their names)."""

    def _get_lora_unwrapped_name(self, megatron_param: str) -> str:
        """A LoRA-wrapped layer's parameter by its base's name (``.to_wrap.`` dropped)."""
        return megatron_param.replace(".to_wrap.", ".")

    def _is_adapter_param_name(self, param_name: str) -> bool:
        """Whether the parameter belongs to a PEFT adapter only."""
        return ".adapter." in param_name

    def stream_adapter_weights_megatron_to_hf(
        self, megatron_model, cpu: bool = True, show_progress: bool = True, exclude_adapter_base_prefixes=None,
        expand_shared_outer: bool = False,
    ):  # fmt: skip
        """(Hugging Face LoRA name, whole tensor) of every adapter, unmerged, on every rank (see
        ``_stream_adapter_weights``). Collective over TP and PP. ``expand_shared_outer`` concerns
        shared-outer expert adapters only, which megatron_lite's LoRA refuses: it changes nothing."""
        del expand_shared_outer  # no shared-outer adapter exists to expand
        return _stream_adapter_weights(
            self, megatron_model, cpu, show_progress, exclude_adapter_base_prefixes
        )


def infer_target_modules_from_adapter_weights(adapter_weight_names) -> list[str]:
    """PEFT's ``target_modules`` from the LoRA names: the module names (``q_proj``, ``gate_proj``...)."""
    modules = set()
    for name in adapter_weight_names:
        for suffix in _HF_LORA_SUFFIXES:
            if name.endswith(suffix):
                modules.add(name[: -len(suffix)].rsplit(".", 1)[-1])
    return sorted(modules)


def infer_rank_pattern_from_adapter_weights(adapter_weights, *, default_rank: int) -> dict[str, int]:
    """PEFT's ``rank_pattern``: the targets whose LoRA rank is not ``default_rank``."""
    ranks = {}
    for name, tensor in adapter_weights:
        if name.endswith(".lora_A.weight"):
            ranks[name.removesuffix(".lora_A.weight")] = tensor.shape[0]
    return {target: rank for target, rank in ranks.items() if rank != default_rank}


def build_adapter_config_dict(
    peft_config, target_modules: list[str], base_model_name_or_path: str | None = None, rank_pattern=None,
    fan_in_fan_out: bool = False,
) -> dict:  # fmt: skip
    """``adapter_config.json`` as the ``peft`` library reads it (Megatron-Bridge's fields and values):
    LoRA of rank ``dim`` scaled by ``alpha / dim``, dropout on the adapter's input."""
    return {
        "peft_type": "LORA",
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path or "",
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,  # the base's layers store [in, out] (GPT-2's Conv1D)
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_alpha": getattr(peft_config, "alpha", 32),
        "lora_dropout": getattr(peft_config, "dropout", 0.0),
        "modules_to_save": None,
        "r": getattr(peft_config, "dim", 32),
        "rank_pattern": rank_pattern or {},
        "alpha_pattern": {},
        "target_modules": target_modules,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
