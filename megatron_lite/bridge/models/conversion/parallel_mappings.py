"""How one Hugging Face tensor splits over TP ranks: whole (Direct, Replicated), by rows
(ColumnParallel), by columns (RowParallel), or as the megatron module or parameter says (AutoMapping).
param_mapping.py serves them under Megatron-Bridge's names."""

from __future__ import annotations

import torch

from megatron_lite.bridge.models.conversion.experts import split_dim
from megatron_lite.bridge.models.conversion.param_mapping_base import MegatronParamMapping, _tp_range
from megatron_lite.core.models.gpt.state_dict_sharding import VOCAB_PARALLEL


class DirectMapping(MegatronParamMapping):
    """The same tensor on both sides, no TP split."""

    def hf_to_megatron(self, hf_weights, megatron_module):
        return hf_weights

    def megatron_to_hf(self, megatron_weights, megatron_module):
        megatron_weights = self.broadcast_from_pp_rank(megatron_weights, cache_key=str(self.hf_param))
        return {} if megatron_weights is None else {self.hf_param: megatron_weights}


class ReplicatedMapping(DirectMapping):
    """The same tensor whole on every TP rank (norms, routers): sent from TP rank 0 on load."""

    def hf_to_megatron(self, hf_weights, megatron_module):
        device = next(megatron_module.parameters()).device
        if self.tp_size == 1:
            return hf_weights.to(device)
        weights = hf_weights.to(device) if self.tp_rank == 0 else torch.empty_like(hf_weights, device=device)
        return self.broadcast_tensor_to_tp_ranks(weights, src_rank=0)


class ColumnParallelMapping(DirectMapping):
    """Split along dim 0 (output features, the vocabulary): each TP rank holds a block of rows."""

    _tp_dim = 0

    def _splits(self, hf_weights, target):
        if hf_weights is None:
            raise ValueError("hf_weights should not be None on rank 0")
        dim, full = self._tp_dim, target.shape[self._tp_dim] * self.tp_size
        if self._tp_dim == 0 and hf_weights.shape[0] < full and self.megatron_param.endswith(VOCAB_PARALLEL):
            hf_weights = torch.cat(
                (hf_weights, hf_weights.new_zeros(full - hf_weights.shape[0], *hf_weights.shape[1:]))
            )
        if hf_weights.shape[dim] % self.tp_size:
            raise ValueError(
                f"Cannot evenly split dimension {dim} size {hf_weights.shape[dim]} across {self.tp_size} TP ranks"
            )
        return torch.chunk(hf_weights.to(target.dtype), self.tp_size, dim=dim)

    def hf_to_megatron(self, hf_weights, megatron_module):
        if self.tp_size == 1:
            return hf_weights
        target = self._target_param(megatron_module)
        splits = self._splits(hf_weights, target) if self.tp_rank == 0 else None
        return self.scatter_to_tp_ranks(splits, target.shape, target.dtype, target.device)

    def megatron_to_hf(self, megatron_weights, megatron_module):
        megatron_weights = self.broadcast_from_pp_rank(megatron_weights, cache_key=str(self.hf_param))
        if megatron_weights is None:
            return {}
        if self.tp_size > 1 and megatron_weights.dim() > self._tp_dim:
            megatron_weights = torch.cat(self.gather_from_tp_ranks(megatron_weights), dim=self._tp_dim)
        return {self.hf_param: megatron_weights}


class RowParallelMapping(ColumnParallelMapping):
    """Split along dim 1 (input features); a bias (1-D) is whole on every TP rank."""

    _tp_dim = 1

    def _splits(self, hf_weights, target):
        if hf_weights is not None and hf_weights.dim() == 1:
            return [hf_weights.to(target.dtype)] * self.tp_size
        return super()._splits(hf_weights, target)


class AutoMapping(MegatronParamMapping):
    """One Hugging Face tensor, split over TP ranks the way the megatron parameter is: Megatron-Bridge's
    picks column, row or replicated from the module's type; the bridge's streams from the parameter's
    name (state_dict_sharding's rule, experts.py's for experts), vocabulary padding included.
    ``permute_dims`` reorders the Hugging Face tensor's dims into megatron's (``(1, 0)`` for GPT-2's
    ``Conv1D``); the way back applies the inverse."""

    _MODULE_TYPE_REGISTRY: dict[str, set[str]] = {
        "column": {
            "ColumnParallelLinear",
            "TEColumnParallelLinear",
            "TELayerNormColumnParallelLinear",
            "VocabParallelEmbedding",
        },
        "row": {"RowParallelLinear", "TERowParallelLinear"},
        "replicated": {
            "LayerNorm",
            "RMSNorm",
            "TENorm",
            "FusedLayerNorm",
            "WrappedTorchNorm",
            "TopKRouter",
            "IdentityOp",
        },
    }

    @classmethod
    def register_module_type(cls, module_name: str, parallelism_type: str) -> None:
        if parallelism_type not in cls._MODULE_TYPE_REGISTRY:
            raise ValueError(
                f"Invalid parallelism_type '{parallelism_type}': one of {list(cls._MODULE_TYPE_REGISTRY)}"
            )
        cls._MODULE_TYPE_REGISTRY[parallelism_type].add(module_name)

    def __init__(self, megatron_param: str, hf_param: str, permute_dims: tuple[int, ...] | None = None):
        super().__init__(megatron_param, hf_param)
        self.permute_dims = tuple(permute_dims) if permute_dims is not None else None
        self._mapping = self._detected_type = None

    def resolve(self, captures) -> AutoMapping:
        return type(self)(*self._resolve_names(tuple(captures)), self.permute_dims)

    def _detect_parallelism_type(self, module) -> str:
        name = type(module).__name__
        for kind, names in self._MODULE_TYPE_REGISTRY.items():
            if name in names:
                return kind
        if hasattr(module, "tensor_model_parallel"):
            if not module.tensor_model_parallel:
                return "replicated"
            kind = {0: "column", 1: "row"}.get(getattr(module, "partition_dim", None))
            if kind:
                return kind
        if "Norm" in name:
            return "replicated"
        raise ValueError(
            f"Cannot determine parallelism type for module '{name}' at weight '{self.megatron_param}': use an "
            f"explicit mapping or AutoMapping.register_module_type('{name}', 'column|row|replicated')"
        )

    def _get_or_create_mapping(self, kind: str) -> MegatronParamMapping:
        cls = {"column": ColumnParallelMapping, "row": RowParallelMapping, "replicated": ReplicatedMapping}[
            kind
        ]
        return cls(self.megatron_param, self.hf_param)

    def _inverse(self) -> tuple[int, ...]:
        return tuple(sorted(range(len(self.permute_dims)), key=self.permute_dims.__getitem__))

    def hf_to_megatron(self, hf_weights, megatron_module):
        if self.permute_dims is not None:
            hf_weights = hf_weights.permute(self.permute_dims).contiguous()
        if self._mapping is None:
            self._detected_type = self._detect_parallelism_type(megatron_module)
            self._mapping = self._get_or_create_mapping(self._detected_type)
        return self._mapping.hf_to_megatron(hf_weights, megatron_module)

    def megatron_to_hf(self, megatron_weights, megatron_module):
        if self._mapping is None:
            kind = self._detect_parallelism_type(megatron_module) if megatron_module is not None else None
            self._detected_type = self.broadcast_obj_from_pp_rank(kind, "detected_type")
            if self._detected_type is None:
                return {}
            self._mapping = self._get_or_create_mapping(self._detected_type)
        result = self._mapping.megatron_to_hf(megatron_weights, megatron_module)
        if self.permute_dims is not None and result:
            result = {self.hf_param: next(iter(result.values())).permute(self._inverse()).contiguous()}
        return result

    def read_shard(self, read, shape, tp_rank, tp_size, config):
        dim = split_dim(self.megatron_param)
        if self.megatron_param.endswith(VOCAB_PARALLEL):
            # Rows of the padded vocabulary: the part past the real vocabulary is zeros.
            start = tp_rank * shape[0]
            rows = read(
                self.hf_param, 0, min(start, config.vocab_size), min(start + shape[0], config.vocab_size)
            )
            if rows.shape[0] == shape[0]:
                return rows
            shard = rows.new_zeros(shape)
            shard[: rows.shape[0]] = rows
            return shard
        permute = (
            self.permute_dims
            if self.permute_dims is not None and len(shape) == len(self.permute_dims)
            else None
        )
        if dim is None or tp_size == 1:
            tensor = read(self.hf_param, None, 0, None)
        else:  # megatron's dim ``dim`` is the Hugging Face tensor's ``permute[dim]``
            hf_dim = dim if permute is None else permute[dim]
            tensor = read(self.hf_param, hf_dim, *_tp_range(shape[dim] * tp_size, tp_rank, tp_size))
        return tensor if permute is None else tensor.permute(permute)

    def full_to_hf(self, full, config):
        if self.permute_dims is not None and full.dim() == len(self.permute_dims):
            full = full.permute(self._inverse())
        return {self.hf_param: full}
