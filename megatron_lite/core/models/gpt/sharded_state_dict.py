"""Where each of a GPTModel chunk's parameters sits in a ``torch_dist`` checkpoint: megatron-core's
``GPTModel.sharded_state_dict`` keys and layout, so the checkpoint is the same whatever the layout
that wrote it.

- Layers are stacked: ``decoder.layers.N.X`` is layer N of the global tensor ``decoder.layers.X``
  (first axis: the whole model's layers), and the layer norms take Transformer Engine's names
  (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``, ``pre_mlp_layernorm.`` ->
  ``mlp.linear_fc1.layer_norm_``), as megatron-core maps its local layers too.
- TP splits follow ``state_dict_sharding``: column-parallel rows, row-parallel columns, a gated
  ``linear_fc1`` as its gate rows then its up rows (the global tensor is ``[gate; up]``), the
  vocabulary-parallel tensors with their padding (a load at another padding takes the overlap).
- MoE layers: routed experts as ``expert_sharding`` places them, the router and shared experts by
  their own names, the ``pre_mlp_layernorm`` kept. With upstream's non-homogeneous layers (dense and
  MoE mixed by ``moe_layer_freq``) nothing is stacked: ``decoder.layers.N.X`` is its own tensor.
- A chunk's output layer tied to the word embedding is that embedding: read from it, never written.
"""

from __future__ import annotations

import re

from megatron_lite.core.dist_checkpointing.mapping import Slab
from megatron_lite.core.models.gpt.expert_sharding import expert_split_dim, routed_expert
from megatron_lite.core.models.gpt.state_dict_sharding import (
    VOCAB_PARALLEL,
    adapter_of,
    is_gated_fc1,
    layer_index,
    tp_split_dim,
)
from megatron_lite.core.utils import unwrap_model

_NORM_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
_TIED = "embedding.word_embeddings.weight"


def checkpoint_key(name: str, *, moe: bool = False, stacked: bool = True) -> str:
    """The global tensor that holds state-dict entry ``name`` (without its layer number when the layers
    are ``stacked``). A MoE layer keeps its ``pre_mlp_layernorm`` (upstream's MoE layer has no fused
    ``linear_fc1`` to carry it)."""
    index = layer_index(name)
    if index is None:
        return name
    rest = name.split(".", 3)[3]
    for ours, theirs in _NORM_KEYS.items():
        if rest.startswith(ours) and not (moe and ours == "pre_mlp_layernorm."):
            rest = theirs + rest[len(ours) :]
    expert = routed_expert(rest)
    if expert is not None:
        rest = expert[0]
    return "decoder.layers." + ("" if stacked else f"{index}.") + rest


def _split_slabs(key, local_shape, dim, *, gated, rank, size, layer, vocab=False, expert=None):
    """``(slabs, replicated)`` of a local tensor split along ``dim`` (None: whole) over ``size`` ranks."""
    rows = local_shape[0] if local_shape else 1
    if dim is None:
        return [Slab(key, 0, rows, (0,) * len(local_shape), local_shape, layer, expert=expert)], True
    if dim == 1:
        shape = (local_shape[0], local_shape[1] * size, *local_shape[2:])
        offset = (0, local_shape[1] * rank) + (0,) * (len(local_shape) - 2)
        return [Slab(key, 0, rows, offset, shape, layer, expert=expert)], False
    rest = (0,) * (len(local_shape) - 1)
    shape = (rows * size, *local_shape[1:])
    if gated:
        half = rows // 2
        return [
            Slab(key, 0, half, (half * rank, *rest), shape, layer, expert=expert),
            Slab(key, half, rows, (half * (size + rank), *rest), shape, layer, expert=expert),
        ], False
    return [Slab(key, 0, rows, (rows * rank, *rest), shape, layer, vocab, expert=expert)], False


_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def expert_adapter(name: str) -> tuple[str, int | None] | None:
    """For a LoRA adapter of a routed expert layer: ``(its name with the experts' global key, the local
    expert index)``; the index is None for one adapter shared by a rank's grouped experts (and by every
    expert-parallel rank). None for any other entry."""
    if adapter_of(name) is None or ".mlp.experts." not in name:
        return None
    match = _LOCAL_EXPERT.search(name)
    if match is None:
        return name, None
    return name[: match.start()] + ".experts." + name[match.end() :], int(match.group(1))


def _expert_adapter_slabs(name, local_shape, *, gated, layer, moe, stacked, experts):
    """``(slabs, replicated)`` of a routed expert layer's adapter: split over expert TP as its base
    (fc1 column-, fc2 row-parallel), on the global expert axis when it is one expert's."""
    renamed, local = expert_adapter(name)
    base, part = adapter_of(renamed)
    first, count, etp_rank, etp_size = experts
    return _split_slabs(
        checkpoint_key(renamed, moe=moe, stacked=stacked),
        local_shape,
        1 if part == "linear_in" and ".linear_fc2." in base else 0,
        gated=gated and part == "linear_out" and ".linear_fc1." in base,
        rank=etp_rank,
        size=etp_size,
        layer=layer,
        expert=None if local is None else (first + local, count),
    )


def parameter_slabs(
    name: str,
    local_shape,
    *,
    layer_offset: int,
    num_layers: int,
    tp_rank: int,
    tp_size: int,
    gated: bool,
    moe: bool = False,
    stacked: bool = True,
    experts: tuple[int, int, int, int] = (0, 1, 0, 1),
) -> tuple[list[Slab], bool]:
    """``(slabs, replicated_over_tp)`` for the local (this TP rank's) entry ``name`` of a chunk whose
    first layer is the model's ``layer_offset``; ``moe``: the entry's layer is a MoE layer;
    ``stacked``: the layers share tensors (False: upstream's non-homogeneous layers, one key per layer);
    ``experts``: (this rank's first global expert, number of experts, expert-TP rank, expert-TP size),
    a routed expert being replicated over expert TP rather than TP."""
    local_shape = tuple(local_shape)
    key, index = checkpoint_key(name, moe=moe, stacked=stacked), layer_index(name)
    layer = None if index is None or not stacked else (index + layer_offset, num_layers)
    if expert_adapter(name) is not None:
        return _expert_adapter_slabs(
            name, local_shape, gated=gated, layer=layer, moe=moe, stacked=stacked, experts=experts
        )
    routed = routed_expert(name)
    if routed is not None:
        first, count, etp_rank, etp_size = experts
        checkpoint_name = routed[0]
        return _split_slabs(
            key,
            local_shape,
            expert_split_dim(checkpoint_name),
            gated=gated and ".linear_fc1." in checkpoint_name,
            rank=etp_rank,
            size=etp_size,
            layer=layer,
            expert=(first + routed[1], count),
        )
    return _split_slabs(
        key,
        local_shape,
        tp_split_dim(name),
        gated=is_gated_fc1(name, gated),
        rank=tp_rank,
        size=tp_size,
        layer=layer,
        vocab=name in VOCAB_PARALLEL,
    )


def chunk_slabs(
    chunk,
    *,
    layer_offset: int,
    num_layers: int,
    tp_rank: int,
    tp_size: int,
    gated: bool,
    tied: bool,
    stacked: bool = True,
    experts: tuple[int, int, int, int] = (0, 1, 0, 1),
):
    """``{parameter: (slabs, replicated, read_only, routed_expert)}`` for a model chunk (DDP-wrapped
    or not); ``replicated``: over TP (a routed expert: over expert TP); ``read_only``: an output layer
    tied to the word embedding in a chunk without it (a copy, loaded from the embedding and never
    saved)."""
    # A LoRA-wrapped layer's base parameters keep the base's keys (Bridge's state dict drops
    # ``to_wrap.``, the wrapper's attribute).
    params = {n.replace(".to_wrap.", "."): p for n, p in unwrap_model(chunk).named_parameters()}
    moe_layers = {layer_index(n) for n in params if ".mlp.router." in n}
    found = {}
    for name, param in params.items():
        read_only = tied and name == "output_layer.weight" and _TIED not in params
        slabs, replicated = parameter_slabs(
            _TIED if read_only else name,
            param.shape,
            layer_offset=layer_offset,
            num_layers=num_layers,
            tp_rank=tp_rank,
            tp_size=tp_size,
            gated=gated,
            moe=layer_index(name) in moe_layers,
            stacked=stacked,
            experts=experts,
        )
        # An adapter shared by every expert-parallel rank (the same tensor on each) is written by the
        # first of them only: the others read it back.
        shared = expert_adapter(name) is not None and expert_adapter(name)[1] is None
        read_only = read_only or (shared and experts[0] > 0)
        expert = routed_expert(name) is not None or expert_adapter(name) is not None
        found[param] = (slabs, replicated and not read_only, read_only, expert)
    return found
