"""What the bridge's weight streams carry, under Megatron-Bridge's names (model_bridge.py serves them):
``HFWeightTuple`` (a Hugging Face name and tensor), ``MegatronWeightTuple`` and ``WeightConversionTask``
(one megatron parameter, its mapping and, on the rank that holds it, the tensor)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

# export_hook(hf_name, tensor) -> (hf_name, tensor) pairs: zero, one or several per exported tensor
# (a quantizer's packed weight and its scales, say), run before the tensor is moved to the CPU.
ExportHook = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


class MegatronWeightTuple(NamedTuple):
    """A megatron weight by its name, with the virtual-pipeline stage that holds it."""

    param_name: str
    weight: torch.Tensor
    vp_stage: int


class HFWeightTuple(NamedTuple):
    """A Hugging Face weight: unpacks as ``name, tensor``, as the streams' callers expect."""

    param_name: str
    weight: torch.Tensor

    def iter_finalized(
        self, *, cpu: bool, export_hook: ExportHook | None = None, clone_identity_output: bool = False
    ) -> Iterable[HFWeightTuple]:
        """The weight(s) to write: ``export_hook``'s outputs (or the weight itself), detached, then on
        the CPU when ``cpu``. The hook sees the tensor before it moves, so it may work on the device.
        ``clone_identity_output`` copies an output that is the input itself, so that a second name
        (a tied output layer) gets storage of its own."""
        source = self.weight.detach()
        outputs = (
            export_hook(self.param_name, source) if export_hook is not None else ((self.param_name, source),)
        )
        for name, tensor in outputs:
            is_source = tensor is source
            tensor = tensor.detach()
            if clone_identity_output and is_source:
                tensor = tensor.clone()
            yield HFWeightTuple(name, tensor.cpu() if cpu else tensor)


@dataclass(frozen=True)
class WeightConversionTask:
    """One megatron parameter to convert, either way. ``param_name`` is this rank's name (local layer
    numbers), ``global_param_name`` the whole model's; ``pp_rank`` / ``vp_stage`` say where it lives;
    ``megatron_module`` and ``param_weight`` are None on ranks that do not hold it. ``weight_dtype``
    casts floating-point exports; ``export_hook`` transforms each exported tensor (see HFWeightTuple)."""

    param_name: str
    global_param_name: str
    mapping: Any
    pp_rank: int | None = None
    vp_stage: int | None = None
    megatron_module: torch.nn.Module | None = None
    param_weight: torch.Tensor | None = None
    weight_dtype: torch.dtype | None = None
    export_hook: ExportHook | None = field(default=None, compare=False, repr=False)
