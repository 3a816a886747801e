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

from megatron_lite.core.dist_checkpointing.mapping import Slab
from megatron_lite.core.models.gpt.expert_sharding import expert_split_dim, routed_expert
from megatron_lite.core.models.gpt.state_dict_sharding import (
    VOCAB_PARALLEL,
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
    params = dict(unwrap_model(chunk).named_parameters())
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
        found[param] = (slabs, replicated and not read_only, read_only, routed_expert(name) is not None)
    return found
