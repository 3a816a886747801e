"""How each GPTModel state-dict entry is split over tensor-parallel ranks and where its layer sits in
the whole model: what a Hugging Face import, an export and a load at another layout all need.

The rules are megatron-core's (its ``sharded_state_dict`` factories):
- ``linear_qkv`` is column-parallel and group-major (per query group: its query heads, key, value), so
  TP rank r holds groups ``[r G/T, (r+1) G/T)`` as one contiguous block of rows;
- a gated ``linear_fc1`` holds ``[gate; up]`` on every rank: rank r's rows are its slice of the gate
  followed by its slice of the up projection (megatron-core's ``apply_swiglu_sharded_factory``);
- ``linear_proj`` / ``linear_fc2`` weights are row-parallel (split along dim 1), their biases whole;
- a MoE layer's shared experts (``mlp.shared_experts.linear_fc1`` / ``linear_fc2``) split like the dense
  MLP; its router and shared-expert gate are replicated (routed experts: ``expert_sharding``);
- the word embedding and the output layer split the padded vocabulary along dim 0. The full tensor
  here is the unpadded one (``vocab_size`` rows): padding rows are zeros, added per layout;
- everything else (norms, position embeddings, row-parallel biases) is replicated;
- a LoRA adapter of a layer (``<layer>.adapter.linear_in.weight`` / ``linear_out.weight``, Megatron-Bridge's
  ``ParallelLinearAdapter``) follows its base: ``linear_out`` is split by rows (a gated ``linear_fc1``'s as
  ``[gate; up]``, the rows it adds to), ``linear_in`` by rows under a column-parallel base and by
  columns under a row-parallel one; an adapter of a replicated layer is replicated.
"""

from __future__ import annotations

import re

import torch

VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_FC1 = (
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "shared_experts.linear_fc1.weight",
    "shared_experts.linear_fc1.bias",
)
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "shared_experts.linear_fc2.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_ADAPTER = re.compile(r"^(?P<base>.+)\.adapter\.(?P<part>linear_in|linear_out)\.weight$")


def adapter_of(name: str) -> tuple[str, str] | None:
    """``(the base layer's weight name, "linear_in" | "linear_out")`` for a LoRA adapter's entry; None
    for any other."""
    match = _ADAPTER.match(name)
    return None if match is None else (match["base"] + ".weight", match["part"])


def tp_split_dim(name: str) -> int | None:
    """The dim ``name`` is split along over TP ranks; None when every rank holds all of it."""
    adapter = adapter_of(name)
    if adapter is not None:
        base, part = adapter
        base_dim = tp_split_dim(base)
        if base_dim is None:
            return None
        return 1 if part == "linear_in" and base_dim == 1 else 0
    if name in VOCAB_PARALLEL or name.endswith(_COLUMN) or name.endswith(_FC1):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def is_gated_fc1(name: str, gated: bool) -> bool:
    """A gated ``linear_fc1``'s weight or bias, or its adapter's ``linear_out`` (which adds to its rows)."""
    adapter = adapter_of(name)
    if adapter is not None:
        return adapter[1] == "linear_out" and is_gated_fc1(adapter[0], gated)
    return gated and name.endswith(_FC1)


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int, *, gated: bool, padded_vocab: int):
    """Rank ``tp_rank``'s part of the whole tensor ``full`` (for the vocabulary-parallel tensors, the
    unpadded one, padded here to ``padded_vocab`` rows with zeros). A view where one suffices."""
    dim = tp_split_dim(name)
    if name in VOCAB_PARALLEL:
        rows = padded_vocab // tp_size
        start, stop = tp_rank * rows, (tp_rank + 1) * rows
        shard = full.new_zeros((rows, *full.shape[1:]))
        have = max(0, min(stop, full.shape[0]) - start)
        shard[:have] = full[start : start + have]
        return shard
    if dim is None or tp_size == 1:
        return full
    if is_gated_fc1(name, gated):
        gate, up = full.chunk(2, dim=0)
        return torch.cat((gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]))
    return full.chunk(tp_size, dim=dim)[tp_rank]


def merge_tp_shards(name: str, shards: list[torch.Tensor], *, gated: bool, vocab_size: int) -> torch.Tensor:
    """The whole tensor from every TP rank's part, in rank order (the inverse of ``tp_shard``)."""
    dim = tp_split_dim(name)
    if dim is None:
        return shards[0]
    if is_gated_fc1(name, gated):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([g for g, _ in halves] + [u for _, u in halves])
    full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)
    return full[:vocab_size] if name in VOCAB_PARALLEL else full


def layer_index(name: str) -> int | None:
    """The layer number in a ``decoder.layers.N.`` name; None for a name outside the layers."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def with_layer_index(name: str, index: int) -> str:
    """``name`` with its layer number replaced by ``index``."""
    return _LAYER.sub(f"decoder.layers.{index}.", name, count=1)


def global_name(name: str, layer_offset: int) -> str:
    """A model chunk's state-dict key with its local layer number made the whole model's (0-based)."""
    index = layer_index(name)
    return name if index is None else with_layer_index(name, index + layer_offset)
