"""Weights-only loads (``--finetune``, ``--pretrained-checkpoint``) of a checkpoint saved at another
layout: another tensor- or pipeline-parallel size, another number of model chunks per stage or another
split of the layers over stages.

Each of this rank's state-dict entries is named as in the whole model, found in the saved stage that
holds it, merged from every saved TP rank's part and cut to this rank's part
(``core.models.gpt.state_dict_sharding``). The saved stages are read one at a time, each file mapped
rather than read, so a rank reads only the pages of the tensors it takes.
"""

from __future__ import annotations

import os

import torch

from megatron_lite.core import parallel_state
from megatron_lite.core.models.gpt.state_dict_sharding import (
    VOCAB_PARALLEL,
    global_name,
    layer_index,
    merge_tp_shards,
    tp_shard,
    tp_split_dim,
    with_layer_index,
)
from megatron_lite.core.transformer.pipeline_layer_split import chunk_layer_offset, pipeline_layer_counts
from megatron_lite.training.checkpointing.compat import saved_split
from megatron_lite.training.checkpointing.layout import (
    get_checkpoint_name,
    is_distributed_checkpoint,
    model_chunks,
    model_keys,
    read_common,
    read_metadata,
    read_shard,
)
from megatron_lite.training.checkpointing.safety import CheckpointError

_TIED_SOURCE = "embedding.word_embeddings.weight"


def split_differs(saved_config: dict | None, model_cfg) -> bool:
    """Whether the checkpoint's layers sit in other model chunks than this run's (another number of
    chunks, or another split); False when its split cannot be told (the load checks the weights)."""
    before = saved_split(saved_config)
    if before is None:
        return False
    try:
        return pipeline_layer_counts(before) != pipeline_layer_counts(model_cfg)
    except ValueError:
        return False


def read_saved_config(root: str, iteration: int) -> dict:
    """The saving run's config (``plain(ConfigContainer)``): a ``torch_dist`` checkpoint's
    ``common.pt``, else the first stage's first TP (and expert-parallel) shard (mapped, so its tensors
    are not read)."""
    return read_saved_payload(root, iteration)["config"]


def read_saved_payload(root: str, iteration: int) -> dict:
    """What ``read_saved_config`` reads the config from (``common.pt``, or the first shard, mapped),
    with its ``config`` checked to be there."""
    if is_distributed_checkpoint(root, iteration):
        return read_common(root, iteration)
    layout = read_metadata(root, iteration)
    pp, ep = layout.get("pipeline_model_parallel_size", 1), layout.get("expert_model_parallel_size", 1)
    path = get_checkpoint_name(root, iteration, 0, 0, pp, 0, ep)
    if not os.path.exists(path):
        shard = os.path.relpath(path, root)
        raise CheckpointError(
            f"--load {root}: iteration {iteration} has no shard {shard}; the checkpoint is incomplete"
        )
    payload = read_shard(path, root, mmap=True)
    config = payload.get("config") if isinstance(payload, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(
            f"--load {root}: iteration {iteration} holds no saved config, so the layers' stages are unknown; "
            "load it at the saved layout"
        )
    return payload


def describe_layout(tp_size: int, split) -> str:
    """``tp=2 pp=2``, with ``vp=`` for model chunks and the layers per stage when the split is uneven;
    ``split``: a model config, or ``compat.saved_split``'s namespace."""
    pp, vp = split.pipeline_model_parallel_size, split.virtual_pipeline_model_parallel_size or 1
    counts = pipeline_layer_counts(split)
    stages = [sum(row[r] for row in counts) for r in range(pp)]
    layers = f" layers {'/'.join(map(str, stages))}" if len(set(stages)) > 1 else ""
    return f"tp={tp_size} pp={pp}" + (f" vp={vp}" if vp > 1 else "") + layers


def _saved_locator(split, tied_in_one_chunk: bool):
    """``locate(whole-model name) -> (pp_rank, chunk, local name)`` in the checkpoint, or None for a
    layer it does not have."""
    counts = pipeline_layer_counts(split)
    chunks, stages = len(counts), split.pipeline_model_parallel_size
    holder = {}  # layer index -> (pp_rank, chunk, the chunk's first layer)
    for c in range(chunks):
        for r in range(stages):
            offset = chunk_layer_offset(split, c, r)
            holder.update({offset + i: (r, c, offset) for i in range(counts[c][r])})

    def locate(name: str):
        index = layer_index(name)
        if index is not None:
            if index not in holder:
                return None
            r, c, offset = holder[index]
            return r, c, with_layer_index(name, index - offset)
        if name.startswith("embedding."):
            return 0, 0, name
        if name == "output_layer.weight" and tied_in_one_chunk:
            # A one-chunk model with tied weights saved no output layer: it is the word embedding.
            return 0, 0, _TIED_SOURCE
        return stages - 1, chunks - 1, name  # the final norm and the output layer

    return locate


def _stage_shards(root: str, iteration: int, tp_size: int, pp_rank: int, pp_size: int, ranks) -> list:
    """The saved TP ranks' files of one stage, mapped (None for a rank not needed)."""
    shards = []
    for tp_rank in range(tp_size):
        if tp_rank not in ranks:
            shards.append(None)
            continue
        path = get_checkpoint_name(root, iteration, tp_rank, pp_rank, pp_size)
        if not os.path.exists(path):
            shard = os.path.relpath(path, root)
            raise CheckpointError(
                f"--load {root}: iteration {iteration} has no shard {shard}; the checkpoint is incomplete"
            )
        shards.append(read_shard(path, root, mmap=True))
    return shards


def resharded_state(root: str, iteration: int, saved_config: dict, model, model_cfg) -> dict:
    """This rank's ``model`` (or ``model0``, ``model1``, ...) state dicts, taken from a checkpoint of
    another layout: the payload ``load_checkpoint`` loads. Raises CheckpointError (one line) for an
    entry the checkpoint lacks or one of another shape."""
    saved = saved_config["model"]
    split = saved_split(saved_config)
    tp_size, pp_size = saved.get("tensor_model_parallel_size", 1), split.pipeline_model_parallel_size
    try:
        saved_chunks = len(pipeline_layer_counts(split))
        tied_in_one_chunk = (
            saved.get("share_embeddings_and_output_weights", True) and pp_size * saved_chunks == 1
        )
        locate = _saved_locator(split, tied_in_one_chunk)
    except ValueError as err:
        raise CheckpointError(
            f"--load {root}: iteration {iteration}: its layer split cannot be read ({err}); load it at the "
            "saved layout"
        ) from None
    gated = bool(saved.get("gated_linear_unit", False))
    padded = model_cfg.padded_vocab_size
    my_tp, my_tp_size = parallel_state.get_tensor_model_parallel_rank(), model_cfg.tensor_model_parallel_size
    my_pp = parallel_state.get_pipeline_model_parallel_rank()
    chunks = model_chunks(model)
    # What this rank's chunks need, by the saved stage holding it: each stage's files are read once.
    wanted: dict[int, list] = {}
    for c, chunk in enumerate(chunks):
        offset = chunk_layer_offset(model_cfg, c, my_pp)
        for key, like in chunk.state_dict().items():
            source = locate(global_name(key, offset))
            if source is None:
                raise CheckpointError(
                    f"--load {root}: iteration {iteration} holds no {global_name(key, offset)} (whole-model "
                    f"numbering) that this run's model needs"
                )
            wanted.setdefault(source[0], []).append((c, key, like, *source[1:]))
    states: list[dict] = [{} for _ in chunks]
    for stage in sorted(wanted):
        split_keys = any(tp_split_dim(saved_key) is not None for *_, saved_key in wanted[stage])
        shards = _stage_shards(
            root, iteration, tp_size, stage, pp_size, range(tp_size) if split_keys else [0]
        )
        for c, key, like, saved_chunk, saved_key in wanted[stage]:
            model_key = model_keys(saved_chunks)[saved_chunk]
            parts = [None if s is None else s.get(model_key, {}).get(saved_key) for s in shards]
            if tp_split_dim(saved_key) is None:
                parts = parts[:1]
            if any(p is None for p in parts):
                raise CheckpointError(
                    f"--load {root}: iteration {iteration} holds no {saved_key} in {model_key} of stage "
                    f"{stage}, which this run's {key} needs"
                )
            if not isinstance(like, torch.Tensor):
                states[c][key] = parts[0]
                continue
            # The saved padding rows are kept where this run's padding has room for them (as upstream's
            # checkpoint converter does): the output layer's padding logits are part of the softmax.
            rows = sum(p.shape[0] for p in parts) if saved_key in VOCAB_PARALLEL else None
            full = merge_tp_shards(saved_key, parts, gated=gated, vocab_size=rows)
            # A copy: the part must not keep the mapped file or the merged tensor alive.
            mine = tp_shard(key, full, my_tp, my_tp_size, gated=gated, padded_vocab=padded).clone()
            if mine.shape != like.shape:
                raise CheckpointError(
                    f"--load {root}: iteration {iteration}: {saved_key} of stage {stage} gives this rank a "
                    f"{tuple(mine.shape)} tensor but this run's {key} is {tuple(like.shape)}"
                )
            states[c][key] = mine
        del shards  # one saved stage at a time
    return dict(zip(model_keys(len(chunks)), states))
