"""MegatronParamMapping: one megatron-core parameter and the Hugging Face tensor(s) it is made of.

Each mapping has two pairs of directions. Megatron-Bridge's ``hf_to_megatron(hf_weights, module)`` /
``megatron_to_hf(megatron_weights, module)`` take whole tensors on TP rank 0 and scatter, or gather
shards over TP and PP (the collectives are mapping_communications.py's). The bridge's own streams use
``read_shard`` (this TP rank's rows or columns, read straight from the files: no rank holds a whole
tensor it does not need) and ``full_to_hf`` (the Hugging Face tensors of a TP-merged tensor).
Names may hold ``*`` (digits: the layer number, then the global expert index) and ``**`` wildcards;
``resolve(captures)`` fills them in, in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_lite.bridge.models.conversion.mapping_communications import MappingCommunications
from megatron_lite.bridge.models.conversion.utils import get_module_and_param_from_name
from megatron_lite.core import parallel_state

# Where the constructor reads parallel state: param_mapping.py points it at its ``mpu`` (Megatron-Bridge's
# name there, which upstream's tests patch).
_parallel_state: Callable = lambda: parallel_state  # noqa: E731


def use_parallel_state(source: Callable) -> None:
    global _parallel_state
    _parallel_state = source


# read(hf_name, dim, start, stop): that range of the tensor along dim (the whole tensor for dim None).
Reader = Callable[[str, int | None, int, int | None], torch.Tensor]


def _tp_range(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    part = size // tp_size
    return tp_rank * part, (tp_rank + 1) * part


def _fill(pattern: str, captures) -> str:
    """``pattern`` with its ``**`` wildcards, then its ``*`` ones, replaced by ``captures`` in order."""
    used = 0
    for wildcard in ("**", "*"):
        while wildcard in pattern and used < len(captures):
            pattern, used = pattern.replace(wildcard, captures[used], 1), used + 1
    return pattern


def _wildcards(pattern: str) -> int:
    return pattern.count("**") + pattern.replace("**", "").count("*")


class MegatronParamMapping(MappingCommunications):
    """One megatron parameter and the Hugging Face tensor(s) it is made of: ``hf_param`` is a name, or
    names by role (``{"q": ..., "k": ..., "v": ...}``)."""

    _tp_dim: int | None = None  # the dim a TP rank's part is cut along (None: whole on every rank)

    def __init__(self, megatron_param: str, hf_param: str | dict[str, str]):
        self.megatron_param, self.hf_param = megatron_param, hf_param
        self._validate_patterns()
        self._broadcast_obj_cache, self._tensor_spec_output_cache = {}, {}
        mpu = _parallel_state()
        ready = mpu.is_initialized()
        self.pp_group = mpu.get_pipeline_model_parallel_group() if ready else None
        self.ep_group = mpu.get_expert_model_parallel_group(check_initialized=False) if ready else None
        self._tp_group = mpu.get_tensor_model_parallel_group() if ready else None
        self._etp_group = mpu.get_expert_tensor_parallel_group(check_initialized=False) if ready else None

    # ---- names ----
    @property
    def hf_param_names(self) -> list[str]:
        return [self.hf_param] if isinstance(self.hf_param, str) else list(self.hf_param.values())

    def _validate_patterns(self) -> None:
        if getattr(self, "is_grouped_export", False):
            return  # the megatron side names one expert, the Hugging Face side all of them
        expected = _wildcards(self.megatron_param)
        for name in self.hf_param_names:
            if _wildcards(name) != expected:
                raise ValueError(
                    f"Wildcard count mismatch: megatron_param='{self.megatron_param}' has {expected} "
                    f"wildcards, hf_param '{name}' has {_wildcards(name)}"
                )

    def _resolve_names(self, captures) -> tuple[str, str | dict[str, str]]:
        hf = self.hf_param
        hf = _fill(hf, captures) if isinstance(hf, str) else {k: _fill(v, captures) for k, v in hf.items()}
        return _fill(self.megatron_param, captures), hf

    def resolve(self, captures) -> MegatronParamMapping:
        """This mapping with its wildcards filled by ``captures`` (a tuple: layer number, expert index)."""
        megatron, hf = self._resolve_names(tuple(captures))
        return type(self)(megatron, **hf) if isinstance(hf, dict) else type(self)(megatron, hf)

    def _get_config(self, module):
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(f"Could not find config in module hierarchy for {self.megatron_param}")
        return config

    def _target_param(self, module) -> torch.Tensor:
        # One expert's parameter stands for all of them: their shapes are the same.
        name = self.megatron_param.rstrip("0123456789") + "0" if self.is_expert else self.megatron_param
        return get_module_and_param_from_name(module, name)[1]

    # ---- Megatron-Bridge's directions (whole tensors on TP rank 0, collectives) ----
    def hf_to_megatron(self, hf_weights, megatron_module) -> torch.Tensor:
        """This TP rank's part of the megatron parameter, from the whole Hugging Face tensor(s) on TP
        rank 0 (None elsewhere)."""
        raise NotImplementedError

    def megatron_to_hf(self, megatron_weights, megatron_module) -> dict[str, torch.Tensor]:
        """The Hugging Face tensors, from this rank's shard (None on PP ranks without it)."""
        raise NotImplementedError

    # ---- the bridge's streams (reads straight from the files) ----
    def read_shard(self, read: Reader, shape: tuple, tp_rank: int, tp_size: int, config) -> torch.Tensor:
        """This TP rank's part of the megatron parameter, whose local shape is ``shape``."""
        dim = self._tp_dim
        if dim is None or tp_size == 1 or len(shape) <= dim:
            return read(self.hf_param, None, 0, None)
        return read(self.hf_param, dim, *_tp_range(shape[dim] * tp_size, tp_rank, tp_size))

    def full_to_hf(self, full: torch.Tensor, config) -> dict[str, torch.Tensor]:
        """The Hugging Face tensors of the whole (TP-merged, unpadded) megatron tensor."""
        return {self.hf_param: full}
