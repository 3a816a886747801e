"""The PEFT method interface (Megatron-Bridge's ``peft.base.PEFT``): freeze the model, then walk it
and let ``transform`` replace the modules it adapts."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from megatron_lite.peft.module_matcher import ModuleMatcher
from megatron_lite.peft.recompute import maybe_enable_recompute_inputs_grad
from megatron_lite.peft.utils import is_adapter_key
from megatron_lite.peft.walk_utils import walk

ModelType = TypeVar("ModelType", nn.Module, list)


def _chunks(model) -> list[nn.Module]:
    """The model chunks: a list as given, DDP's wrapped module, or the one module."""
    if isinstance(model, list):
        return model
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return [model.module]
    return [model]


@dataclass
class PEFT(ABC):
    """A parameter-efficient fine-tuning method. ``peft(model, training=True)`` freezes every base
    parameter, transforms the modules the method adapts (their new parameters trainable) and sets
    the train / eval mode; it returns the model it was given (a list of chunks or one module).
    Apply it to the unwrapped chunks (before DDP), after the base weights are loaded."""

    params_to_save: set[str] = field(default_factory=set, init=False, repr=False)
    """Names of the parameters a PEFT checkpoint saves (set by ``set_params_to_save``)."""

    @abstractmethod
    def transform(self, module: nn.Module, name: str | None = None, prefix: str | None = None) -> nn.Module:
        """The module to put in ``module``'s place (``module`` itself when it is not adapted)."""

    def __call__(self, model: ModelType, training: bool = True) -> ModelType:
        if isinstance(self, ModuleMatcher):
            # A first walk only records matches, to warn of target entries that match nothing.
            self._init_target_match_state()

            def _validate_only(module, name=None, prefix=None):
                self.match(module, name, prefix)
                return module

            self._walk_model(model, _validate_only)
            self._validate_target_matches()
            self._reset_target_match_state()
        self.freeze_model(model, training=training)
        self._walk_model(model, self.transform)
        if training:
            maybe_enable_recompute_inputs_grad(model)
        if not training:
            self.freeze_model(model, training=training)
        for chunk in _chunks(model):
            chunk.train(mode=training)
        return model

    def _walk_model(self, model, func) -> None:
        for chunk in _chunks(model):
            walk(chunk, func)

    def enable_adapter_layers(self, model) -> None:
        """Let every adapter of ``model`` add its output again."""
        for chunk in _chunks(model):
            for m in chunk.modules():
                if callable(getattr(type(m), "enable_adapter_layers", None)):
                    m.enable_adapter_layers()

    def disable_adapter_layers(self, model) -> None:
        """Make every adapted layer of ``model`` return its base output only."""
        for chunk in _chunks(model):
            for m in chunk.modules():
                if callable(getattr(type(m), "disable_adapter_layers", None)):
                    m.disable_adapter_layers()

    @contextmanager
    def disable_adapter(self, model):
        """The base model's behaviour inside the block."""
        try:
            self.disable_adapter_layers(model)
            yield
        finally:
            self.enable_adapter_layers(model)

    def freeze_model(self, model, training: bool = True) -> None:
        """``requires_grad=False`` on every parameter present now (the adapters come after)."""
        for chunk in _chunks(model):
            for p in chunk.parameters():
                p.requires_grad = False
            if training:
                chunk.train(mode=True)

    def set_params_to_save(self, model) -> None:
        """Record the trainable parameters' names (the adapters') and any running-statistics
        buffers: what a PEFT checkpoint holds."""
        self.params_to_save = set()
        for chunk in _chunks(model):
            for name, param in chunk.named_parameters():
                if param.requires_grad:
                    self.params_to_save.add(name)
            for module_name, module in chunk.named_modules():
                if hasattr(module, "track_running_stats"):
                    for buffer_name, buffer in module.named_buffers():
                        if buffer is not None:
                            self.params_to_save.add(f"{module_name}.{buffer_name}")

    def adapter_key_filter(self, key) -> bool:
        """Whether a checkpoint key (or a distributed checkpoint's ``(key, tensor)``) belongs in a
        PEFT checkpoint: a trainable tensor, a recorded parameter, or an adapter's key."""
        if isinstance(key, tuple):
            return key[1].requires_grad
        return key in self.params_to_save or is_adapter_key(key) or key.endswith(".adapters")
