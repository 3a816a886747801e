"""LoRA (Megatron-Bridge's ``peft.lora.LoRA``): every matched linear layer becomes a ``LoRALinear``
adding ``alpha / dim * B(A(x))`` to its output, with ``A`` (``linear_in``) drawn by
``lora_A_init_method`` and ``B`` (``linear_out``) by ``lora_B_init_method`` (zero: the model starts
as the base). Adapters are drawn by the base layer's global name (global layer number, global
expert index), so a model gets the same adapters at any TP / PP / EP layout.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from megatron_lite.core import parallel_state
from megatron_lite.core.process_group_utils import get_pg_size, get_tensor_model_parallel_group_if_none
from megatron_lite.core.transformer.moe.experts import ExpertLinear
from megatron_lite.core.utils import seeded_init
from megatron_lite.peft.base import PEFT
from megatron_lite.peft.expert_adapters import GroupedExpertLinearAdapter
from megatron_lite.peft.init_methods import INIT_METHODS
from megatron_lite.peft.lora_layers import LinearAdapter, LoRALinear
from megatron_lite.peft.module_matcher import ModuleMatcher
from megatron_lite.peft.parallel_adapter import ADAPTER_INIT_SEED, ParallelLinearAdapter
from megatron_lite.peft.utils import (
    get_adapter_attributes_from_linear,
    get_effective_lora_dim,
    is_expert_linear,
    is_grouped_expert_linear,
)

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(^|\.)layers\.(\d+)(?=\.)")
_LOCAL_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)(?=\.)")


def _global_name(name: str, modules: dict[str, nn.Module]) -> tuple[str, nn.Module | None]:
    """``name`` with global layer and expert numbers, and the experts module it sits in (if any): a
    pipeline stage's ``layers.0`` is the model's layer ``layer_number - 1``, an expert-parallel
    rank's ``local_experts.0`` its ``local_expert_offset``-th expert."""
    experts = None
    # Experts first: they follow the layer number, so renumbering the layer shifts no expert position.
    m = _LOCAL_EXPERT.search(name)
    if m:
        experts = modules.get(name[: m.start()])
        number = getattr(experts, "local_expert_offset", 0) + int(m.group(2))
        name = f"{name[: m.start()]}{m.group(1)}local_experts.{number}{name[m.end() :]}"
    m = _LAYER.search(name)
    if m:
        layer_number = getattr(modules.get(name[: m.end()]), "layer_number", None)
        number = layer_number - 1 if layer_number else int(m.group(2))
        name = f"{name[: m.start()]}{m.group(1)}layers.{number}{name[m.end() :]}"
    return name, experts


def _global_names(chunk: nn.Module) -> dict[int, tuple[str, nn.Module | None]]:
    """``id(module) -> _global_name(its name)`` for every module of ``chunk``; an expert linear's
    experts module is its parent."""
    modules = dict(chunk.named_modules())
    out = {}
    for name, module in modules.items():
        global_name, experts = _global_name(name, modules)
        if isinstance(module, ExpertLinear) and experts is None:
            experts = modules.get(name.rpartition(".")[0])
        out[id(module)] = (global_name, experts)
    return out


def _output_stride(module: nn.Module, input_is_parallel: bool, expert_linear: bool) -> int:
    """The base's output-row stride over TP ranks (2: a gated ``linear_fc1``, ``[gate; up]`` per rank)."""
    if input_is_parallel:
        return 1
    weight = module.weights()[0] if expert_linear else getattr(module, "weight", None)
    stride = getattr(weight, "partition_stride", 1)
    return stride if isinstance(stride, int) else 1


@dataclass
class LoRA(PEFT, ModuleMatcher):
    """Low-rank adaptation of the matched linear layers (Bridge's fields and defaults)."""

    target_modules: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )
    """Modules to adapt: names (``linear_qkv``) or full-name patterns with ``*`` wildcards."""
    dim: int = 32
    """Rank of the low-rank update."""
    alpha: int = 32
    """Scale numerator: the update is ``alpha / dim * B A``."""
    dropout: float = 0.0
    """Dropout probability on the adapter's path."""
    dropout_position: Literal["pre", "post"] = "pre"
    """Dropout before ``linear_in`` (``pre``) or after ``linear_out`` (``post``)."""
    sequence_parallel_input_regather: bool = False
    """Under sequence parallelism, linear_qkv's and linear_fc1's adapters keep their input split by
    sequence (1/tp of it) and gather it again in backward for linear_in's weight gradient: same
    results, less activation memory, one more all-gather per adapter in backward. No effect
    without sequence parallelism."""
    lora_A_init_method: str = "xavier"
    """Initialisation of ``linear_in`` (A): xavier, kaiming, normal or zero."""
    lora_B_init_method: str = "zero"
    """Initialisation of ``linear_out`` (B): xavier, kaiming, normal or zero."""
    a2a_experimental: bool = False
    """Bridge's experimental all-to-all adapter output: refused."""
    lora_dtype: torch.dtype | None = None
    """dtype of the adapter parameters; None: the model's."""
    normalize_moe_lora: bool = False
    """Expert layers get rank ``dim // moe_router_topk``."""
    share_expert_adapters: bool = True
    """Grouped experts (TEGroupedMLP) share one adapter, the same on every expert-parallel rank;
    False: one adapter per expert."""
    experts_shared_outer_loras: bool = False
    """Bridge's SGLang-serving layout of grouped-expert adapters: refused."""

    def validate(self) -> None:
        """Raise ValueError (one line) for settings megatron_lite cannot honour."""
        if self.dim <= 0:
            raise ValueError(f"LoRA dim must be positive, not {self.dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), not {self.dropout}")
        if self.dropout_position not in ("pre", "post"):
            raise ValueError(f"LoRA dropout_position must be 'pre' or 'post', not {self.dropout_position!r}")
        for name in ("lora_A_init_method", "lora_B_init_method"):
            if getattr(self, name) not in INIT_METHODS:
                raise ValueError(
                    f"LoRA {name} must be one of {', '.join(INIT_METHODS)}, not {getattr(self, name)!r}"
                )
        if self.a2a_experimental:
            raise ValueError("LoRA a2a_experimental is not supported by megatron_lite")
        if self.experts_shared_outer_loras:
            raise ValueError("LoRA experts_shared_outer_loras is not supported by megatron_lite")
        if self.target_modules and self.exclude_modules:
            raise ValueError("LoRA exclude_modules needs target_modules to be empty")

    def __call__(self, model, training: bool = True):
        self.validate()
        chunks = model if isinstance(model, list) else [getattr(model, "module", model)]
        self._names, self._wrapped = {}, set()
        for chunk in chunks:
            self._names.update(_global_names(chunk))
            # An earlier call's wrappers: their base layer and adapter linears are not adapted again.
            for m in chunk.modules():
                if isinstance(m, LoRALinear):
                    self._wrapped.update(id(sub) for sub in m.modules())
        try:
            return super().__call__(model, training=training)
        finally:
            del self._names, self._wrapped  # this call's bookkeeping only: the config keeps its fields

    def transform(self, module: nn.Module, name: str | None = None, prefix: str | None = None) -> nn.Module:
        """``LoRALinear(module, adapter)`` for a matched module, else ``module``."""
        if isinstance(module, LoRALinear) or id(module) in getattr(self, "_wrapped", ()):
            return module
        ans = self.match(module, name, prefix)
        if ans is None:
            return module
        _, full_name = ans
        names = getattr(self, "_names", {}) or {}
        global_name, experts = names.get(id(module), (full_name, None))
        if isinstance(module, nn.Linear):  # a plain linear layer (Bridge's LinearAdapter)
            with seeded_init(ADAPTER_INIT_SEED, f"lora {global_name} linear_in"):
                adapter = LinearAdapter(
                    module, dim=self.dim, alpha=self.alpha, dropout=self.dropout,
                    dropout_position=self.dropout_position, lora_A_init_method=self.lora_A_init_method,
                    lora_dtype=self.lora_dtype,
                )  # fmt: skip
            return LoRALinear(module, adapter)
        # Experts by type, or by name as Bridge tells them (``...mlp.experts...linear_fc1``).
        expert_linear = isinstance(module, ExpertLinear)
        is_expert = (
            expert_linear or getattr(module, "is_expert", False) is True or is_expert_linear(full_name)
        )
        grouped = module.suffixes != [""] if expert_linear else is_grouped_expert_linear(full_name)
        attrs = get_adapter_attributes_from_linear(
            module,
            is_expert=is_expert,
            sequence_parallel_input_regather=self.sequence_parallel_input_regather and not is_expert,
        )
        dim = get_effective_lora_dim(
            module, dim=self.dim, normalize_moe_lora=self.normalize_moe_lora, is_expert=is_expert
        )
        tp_group = getattr(module, "tp_group", None)
        if tp_group is None and is_expert:
            tp_group = get_tensor_model_parallel_group_if_none(None, is_expert=True)
        tp_size = get_pg_size(tp_group)
        if is_expert and self.normalize_moe_lora and not attrs.input_is_parallel:
            # Bridge rounds a normalised expert rank up to the expert-TP size (the config's, groups unset).
            etp = (
                tp_size
                if tp_group is not None
                else (getattr(module.config, "expert_tensor_parallel_size", 1) or 1)
            )
            dim = -(-dim // etp) * etp
        if not attrs.input_is_parallel and dim % tp_size:
            raise ValueError(
                f"LoRA dim={dim} must be divisible by the tensor-parallel size {tp_size} ({full_name})"
            )
        kwargs = dict(
            base_linear_name=full_name,
            activation="identity",
            column_init_method=self.lora_A_init_method,
            row_init_method=self.lora_B_init_method,
            input_is_parallel=attrs.input_is_parallel,
            dropout=self.dropout,
            dropout_position=self.dropout_position,
            model_parallel_config=module.config,
            alpha=self.alpha,
            base_linear_is_parallel=attrs.base_linear_is_parallel,
            tp_group=tp_group,
            lora_dtype=self.lora_dtype,
            init_key=global_name,
            out_stride=_output_stride(module, attrs.input_is_parallel, expert_linear),
        )
        logger.info("Adding lora to: %s", full_name)
        if grouped and not self.share_expert_adapters:
            first = getattr(experts, "local_expert_offset", 0)
            local = len(module.suffixes) if expert_linear else module.num_gemms
            adapter = GroupedExpertLinearAdapter(
                attrs.in_features, attrs.out_features, dim, num_local_experts=local, first_expert=first,
                **kwargs,
            )  # fmt: skip
        else:
            ep_group = None
            if grouped and parallel_state.model_parallel_is_initialized():
                ep_group = parallel_state.get_expert_model_parallel_group()
            adapter = ParallelLinearAdapter(
                attrs.in_features, attrs.out_features, dim, is_expert=is_expert, ep_group=ep_group,
                disable_tensor_parallel_comm=attrs.disable_tensor_parallel_comm,
                disable_sequence_parallel_comm=attrs.disable_sequence_parallel_comm,
                sequence_parallel_input_regather=self.sequence_parallel_input_regather, **kwargs,
            )  # fmt: skip
        return LoRALinear(module, adapter)
