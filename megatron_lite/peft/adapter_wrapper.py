"""Megatron-Bridge's ``AdapterWrapper``: a base module (``to_wrap``) and its ``adapter``, whose state
dicts keep the base's keys unchanged and put the adapter's under ``adapter.``, so a PEFT model
loads a base checkpoint as it is and a PEFT checkpoint holds the ``adapter.`` keys only."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_lite.peft.sharding import module_sharded_state_dict


class AdapterWrapper(nn.Module):
    """Wraps ``to_wrap`` with ``adapter``; a subclass defines ``forward``. Attributes the wrapper
    lacks are read from the base (``config``, ``tp_group``, ``input_size``, ...), so code that
    inspects a layer sees the layer it wraps."""

    def __init__(self, to_wrap: nn.Module, adapter: nn.Module) -> None:
        super().__init__()
        self.to_wrap = to_wrap
        self.adapter = adapter
        self._adapter_enabled = True
        self._base_returns_tuple = True

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("to_wrap", "adapter") or "to_wrap" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["to_wrap"], name)

    def enable_adapter_layers(self) -> None:
        """The adapter adds its output to the base's (the default)."""
        self._adapter_enabled = True

    def disable_adapter_layers(self) -> None:
        """Forward returns the base's output only."""
        self._adapter_enabled = False

    def base_linear_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        """``(linear_output, bias, layernorm_output)`` from the base, whichever of megatron's return
        forms it uses: ``(out, bias)``, ``((out, ln_out), bias)`` or ``(out, bias, ln_out)``;
        ``layernorm_output`` (the adapter's input) is ``x`` unless the base returns its own. A base
        returning a bare tensor (an expert linear, ``nn.Linear``) is remembered so ``forward``
        returns a bare tensor too; its bias is then the base's ``bias`` attribute."""
        out = self.to_wrap(x, *args, **kwargs)
        if isinstance(out, torch.Tensor):
            self._base_returns_tuple = False
            return out, getattr(self.to_wrap, "bias", None), x
        if not isinstance(out, tuple):
            raise AssertionError(
                f"{self.to_wrap} should return a tensor or a tuple, not {type(out).__name__}"
            )
        self._base_returns_tuple = True
        if len(out) == 3:
            return out
        linear_output, bias = out
        layernorm_output = x
        if isinstance(linear_output, tuple) and len(linear_output) == 2:
            linear_output, layernorm_output = linear_output
        return linear_output, bias, layernorm_output

    def adapter_forward(self, adapter: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run ``adapter`` with the wrapped module's forwarded arguments."""
        return adapter(x, *args, **kwargs)

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The base's entries under their own keys, the adapter's under ``adapter.``."""
        if destination is None:
            destination = {}
        self.to_wrap.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        self.adapter.state_dict(destination=destination, prefix=f"{prefix}adapter.", keep_vars=keep_vars)
        return destination

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # The base's keys carry no ``to_wrap.``: move them under it so nn.Module's load finds them
        # (a base checkpoint loads as it is; its missing adapter keys are reported as missing).
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "adapter.")]:
            rest = key[len(prefix) :]
            if not rest.startswith("to_wrap.") and "." not in rest:
                state_dict[f"{prefix}to_wrap.{rest}"] = state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The base's sharded entries with the keys the unwrapped module has, the adapter's under
        ``adapter.``, each split over its tensor-parallel group."""
        out = {}
        if hasattr(self.to_wrap, "sharded_state_dict"):
            out.update(self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata))
        else:
            out.update(
                module_sharded_state_dict(
                    self.to_wrap, prefix, sharded_offsets, getattr(self.to_wrap, "tp_group", None)
                )
            )
        if hasattr(self.adapter, "sharded_state_dict"):
            out.update(self.adapter.sharded_state_dict(f"{prefix}adapter.", sharded_offsets, metadata))
        else:
            out.update(module_sharded_state_dict(self.adapter, f"{prefix}adapter.", sharded_offsets, None))
        return out
