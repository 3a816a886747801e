"""How one megatron-core parameter is made of Hugging Face tensors, in Megatron-Bridge's names.

A mapping reads, for one tensor-parallel rank, only the rows or columns of the Hugging Face tensors
that rank holds (``hf_to_megatron``), and turns the whole megatron tensor back into Hugging Face
tensors (``megatron_to_hf``). Names may hold ``*`` for the layer number and, after it, the global expert
index (Megatron-Bridge's wildcards); ``resolve`` fills them in, in order.
How a megatron tensor splits over TP ranks is state_dict_sharding's (megatron-core's) rule, and
experts.py's for the mixture-of-experts parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_lite.bridge.models.conversion.experts import split_dim
from megatron_lite.core.models.gpt.state_dict_sharding import VOCAB_PARALLEL

# read(hf_name, dim, start, stop): that range of the tensor along dim (the whole tensor for dim None).
Reader = Callable[[str, int | None, int, int | None], torch.Tensor]


class MegatronParamMapping:
    """One megatron parameter and the Hugging Face tensors (by role) it is made of."""

    def __init__(self, megatron_param: str, **hf_params: str):
        self.megatron_param = megatron_param
        self.hf_params = hf_params

    def resolve(self, *indices: str) -> MegatronParamMapping:
        """This mapping with its ``*``s replaced by ``indices`` in order (the layer number, then the
        global expert index: Hugging Face's numbering)."""
        if not indices:
            return self

        def fill(name: str) -> str:
            for index in indices:
                name = name.replace("*", index, 1)
            return name

        resolved = type(self).__new__(type(self))
        resolved.__dict__ = dict(self.__dict__)
        resolved.megatron_param = fill(self.megatron_param)
        resolved.hf_params = {role: fill(name) for role, name in self.hf_params.items()}
        return resolved

    def hf_to_megatron(self, read: Reader, shape: tuple, tp_rank: int, tp_size: int, config) -> torch.Tensor:
        """This TP rank's part of the megatron parameter, whose local shape is ``shape``."""
        raise NotImplementedError

    def megatron_to_hf(self, full: torch.Tensor, config) -> dict[str, torch.Tensor]:
        """The Hugging Face tensors of the whole (TP-merged, unpadded) megatron tensor."""
        raise NotImplementedError


def _tp_range(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    part = size // tp_size
    return tp_rank * part, (tp_rank + 1) * part


class AutoMapping(MegatronParamMapping):
    """One Hugging Face tensor, the same values (transposed for GPT-2's ``Conv1D``), split over TP ranks
    the way the megatron parameter is: column- or row-parallel, vocabulary-parallel or replicated."""

    def __init__(self, megatron_param: str, hf_param: str, transpose: bool = False):
        super().__init__(megatron_param, hf=hf_param)
        self.transpose = transpose

    def hf_to_megatron(self, read, shape, tp_rank, tp_size, config):
        name, dim = self.hf_params["hf"], split_dim(self.megatron_param)
        hf_dim = None if dim is None else (1 - dim if self.transpose and len(shape) == 2 else dim)
        if self.megatron_param.endswith(VOCAB_PARALLEL):
            # Rows of the padded vocabulary: the part past the real vocabulary is zeros.
            start = tp_rank * shape[0]
            rows = read(name, 0, min(start, config.vocab_size), min(start + shape[0], config.vocab_size))
            if rows.shape[0] == shape[0]:
                return rows
            shard = rows.new_zeros(shape)
            shard[: rows.shape[0]] = rows
            return shard
        if dim is None or tp_size == 1:
            tensor = read(name, None, 0, None)
        else:
            tensor = read(name, hf_dim, *_tp_range(shape[dim] * tp_size, tp_rank, tp_size))
        return tensor.t() if self.transpose and tensor.dim() == 2 else tensor

    def megatron_to_hf(self, full, config):
        return {self.hf_params["hf"]: full.t() if self.transpose and full.dim() == 2 else full}


class QKVMapping(MegatronParamMapping):
    """``linear_qkv`` from separate q, k, v projections. Megatron's rows are group-major (per query
    group: its query heads, then its key, then its value), so a TP rank's rows are its groups' rows
    of each of q, k and v."""

    def __init__(self, megatron_param: str, q: str, k: str, v: str):
        super().__init__(megatron_param, q=q, k=k, v=v)

    def hf_to_megatron(self, read, shape, tp_rank, tp_size, config):
        groups, d = config.num_query_groups, config.kv_channels
        per_group = config.num_attention_heads // groups
        first, last = _tp_range(groups, tp_rank, tp_size)
        n = last - first
        q = read(self.hf_params["q"], 0, first * per_group * d, last * per_group * d)
        k = read(self.hf_params["k"], 0, first * d, last * d)
        v = read(self.hf_params["v"], 0, first * d, last * d)
        rest = q.shape[1:]
        parts = (q.reshape(n, per_group * d, *rest), k.reshape(n, d, *rest), v.reshape(n, d, *rest))
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def megatron_to_hf(self, full, config):
        groups, d = config.num_query_groups, config.kv_channels
        per_group = config.num_attention_heads // groups
        rest = full.shape[1:]
        grouped = full.reshape(groups, per_group + 2, d, *rest)
        return {
            self.hf_params["q"]: grouped[:, :per_group].reshape(-1, *rest).contiguous(),
            self.hf_params["k"]: grouped[:, per_group].reshape(-1, *rest).contiguous(),
            self.hf_params["v"]: grouped[:, per_group + 1].reshape(-1, *rest).contiguous(),
        }


class GatedMLPMapping(MegatronParamMapping):
    """A gated ``linear_fc1`` = ``[gate; up]``; each TP rank holds its slice of both, gate first."""

    def __init__(self, megatron_param: str, gate: str, up: str):
        super().__init__(megatron_param, gate=gate, up=up)

    def hf_to_megatron(self, read, shape, tp_rank, tp_size, config):
        rows = _tp_range(shape[0] // 2 * tp_size, tp_rank, tp_size)
        return torch.cat((read(self.hf_params["gate"], 0, *rows), read(self.hf_params["up"], 0, *rows)))

    def megatron_to_hf(self, full, config):
        gate, up = full.chunk(2, dim=0)
        return {self.hf_params["gate"]: gate.contiguous(), self.hf_params["up"]: up.contiguous()}


def routed_expert_mappings(
    layer: str, experts: str, gate: str, up: str, down: str
) -> list[MegatronParamMapping]:
    """A MoE layer's routed experts, grouped (``linear_fc1.weight<e>``, ``--moe-grouped-gemm``) and
    sequential (``local_experts.<e>.``), from Hugging Face's per-expert projections
    ``{experts}<e>.{gate|up|down}.weight``; ``<e>`` is the global expert index on both sides."""
    hf = lambda name: f"{experts}*.{name}.weight"  # noqa: E731
    prefix = layer + "mlp.experts."
    return [
        GatedMLPMapping(prefix + "linear_fc1.weight*", hf(gate), hf(up)),
        AutoMapping(prefix + "linear_fc2.weight*", hf(down)),
        GatedMLPMapping(prefix + "local_experts.*.linear_fc1.weight", hf(gate), hf(up)),
        AutoMapping(prefix + "local_experts.*.linear_fc2.weight", hf(down)),
    ]
