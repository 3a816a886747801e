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
- A chunk's output layer tied to the word embedding is that embedding: read from it, never written.
"""

from __future__ import annotations

from megatron_lite.core.dist_checkpointing.mapping import Slab
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


def checkpoint_key(name: str) -> str:
    """The global tensor that holds state-dict entry ``name`` (without its layer number)."""
    if layer_index(name) is None:
        return name
    rest = name.split(".", 3)[3]
    for ours, theirs in _NORM_KEYS.items():
        if rest.startswith(ours):
            rest = theirs + rest[len(ours) :]
    return "decoder.layers." + rest


def parameter_slabs(
    name: str, local_shape, *, layer_offset: int, num_layers: int, tp_rank: int, tp_size: int, gated: bool
) -> tuple[list[Slab], bool]:
    """``(slabs, replicated_over_tp)`` for the local (this TP rank's) entry ``name`` of a chunk whose
    first layer is the model's ``layer_offset``."""
    local_shape = tuple(local_shape)
    key, index = checkpoint_key(name), layer_index(name)
    layer = None if index is None else (index + layer_offset, num_layers)
    dim = tp_split_dim(name)
    rows = local_shape[0] if local_shape else 1
    if dim is None:
        return [Slab(key, 0, rows, (0,) * len(local_shape), local_shape, layer)], True
    if dim == 1:
        shape = (local_shape[0], local_shape[1] * tp_size, *local_shape[2:])
        offset = (0, local_shape[1] * tp_rank) + (0,) * (len(local_shape) - 2)
        return [Slab(key, 0, rows, offset, shape, layer)], False
    rest = (0,) * (len(local_shape) - 1)
    shape = (rows * tp_size, *local_shape[1:])
    if is_gated_fc1(name, gated):
        half = rows // 2
        return [
            Slab(key, 0, half, (half * tp_rank, *rest), shape, layer),
            Slab(key, half, rows, (half * (tp_size + tp_rank), *rest), shape, layer),
        ], False
    vocab = name in VOCAB_PARALLEL
    return [Slab(key, 0, rows, (rows * tp_rank, *rest), shape, layer, allow_shape_mismatch=vocab)], False


def chunk_slabs(
    chunk, *, layer_offset: int, num_layers: int, tp_rank: int, tp_size: int, gated: bool, tied: bool
):
    """``{parameter: (slabs, replicated_over_tp, read_only)}`` for a model chunk (DDP-wrapped or not);
    ``read_only``: an output layer tied to the word embedding in a chunk without it (a copy, loaded
    from the embedding and never saved)."""
    params = dict(unwrap_model(chunk).named_parameters())
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
        )
        found[param] = (slabs, replicated and not read_only, read_only)
    return found
