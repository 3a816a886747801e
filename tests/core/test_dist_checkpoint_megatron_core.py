"""A ``torch_dist`` checkpoint interchanges with megatron-core's own ``dist_checkpointing``, both ways,
in a real two-rank gloo world at tensor parallelism 2 (each TP rank writes its own shards and reads
them back through the other framework's mapping): megatron-core saves its GPTModel's
``sharded_state_dict()`` and ``torch_dist.sharded_pieces`` reads it into our GPTModel; our pieces are
saved and megatron-core's ``load`` reads them into its GPTModel. Llama-shaped (RMSNorm, SwiGLU, GQA,
untied embeddings, no biases), so the group-major QKV rows and the ``[gate; up]`` fc1 layout are
exercised. Every tensor must equal bitwise the same-named state-dict entry of the other framework at
the same TP rank, and both models must give the same logits (the tensors mean the same thing).

megatron-core (the dev extra's oracle) runs on the CPU here with a few CUDA calls replaced
(``mcore_helpers``). Both directions run in one world: importing megatron-core costs each rank
seconds, and its save spawns a results-queue manager process once per rank."""

from __future__ import annotations

import json
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_world
from mcore_helpers import (
    SMALL_LLAMA,
    assert_same,
    causal_mask,
    mcore_forward_on_cpu,
    mcore_save_on_cpu,
    poison,
    randomize,
    tensors,
    write_backend_files,
)

from megatron_lite.core import dist_checkpointing, parallel_state
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.training.checkpointing.sharded_pieces import sharded_pieces
from megatron_lite.training.checkpointing.torch_dist import SHARDED_BACKEND

TP = 2
VOCAB, SEQ = 256, 16
_LLAMA = {**SMALL_LLAMA, "tensor_model_parallel_size": TP}  # 2 of the 4 key/value groups per TP rank


def _mcore_model():
    """megatron-core's GPTModel (its local spec: no Transformer Engine) at TP 2, on the CPU."""
    from megatron.core import parallel_state as mcore_parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not mcore_parallel_state.model_parallel_is_initialized():
        mcore_parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    config = TransformerConfig(**_LLAMA, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(
        config, spec, VOCAB, SEQ, share_embeddings_and_output_weights=False, position_embedding_type="rope"
    ).eval()


def _our_model():
    """Ours as training builds it (parallel_state's groups); the provider is the ``model_cfg`` that
    ``sharded_pieces`` reads the layout from. VOCAB is already a multiple of 128 * TP: no padding."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    provider = GPTModelProvider(
        **_LLAMA,
        vocab_size=VOCAB,
        seq_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    assert provider.padded_vocab_size == VOCAB
    return provider.provide().eval(), provider


def _our_pieces(model, provider) -> list:
    return sharded_pieces(model, None, provider, with_optimizer=False)


def _relative_logits_error(mcore, ours) -> float:
    """Max relative difference of this rank's logits (its vocabulary slice) on the same tokens."""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).expand_as(tokens)
    with mcore_forward_on_cpu():
        theirs = mcore(tokens, positions, causal_mask(SEQ))  # [b, s, v / tp]
        mine = ours(tokens, positions).transpose(0, 1)  # [s, b, v / tp] -> [b, s, v / tp]
    assert mine.shape == theirs.shape == (2, SEQ, VOCAB // TP)
    return ((mine - theirs).abs().max() / theirs.abs().max()).item()


def _megatron_core_writes_we_read(root: str) -> float:
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing

    mcore = _mcore_model()
    randomize(mcore, lambda _, param: getattr(param, "tensor_model_parallel", False), dist.get_rank())
    with mcore_save_on_cpu():
        mcore_dist_checkpointing.save(mcore.sharded_state_dict(), root)
    with open(os.path.join(root, "metadata.json")) as f:
        assert json.load(f) == SHARDED_BACKEND  # what save_distributed writes, and load checks for

    ours, provider = _our_model()
    poison(ours)
    pieces = _our_pieces(ours, provider)
    assert dist_checkpointing.missing_or_mismatched(pieces, dist_checkpointing.load_metadata(root)) == []
    with torch.no_grad():
        dist_checkpointing.load(pieces, root)
    assert_same(tensors(ours), tensors(mcore))
    return _relative_logits_error(mcore, ours)


def _we_write_megatron_core_reads(root: str) -> float:
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_lite.core.models.gpt.state_dict_sharding import tp_split_dim

    ours, provider = _our_model()
    randomize(ours, lambda name, _: tp_split_dim(name) is not None, dist.get_rank())
    dist_checkpointing.save(_our_pieces(ours, provider), root)
    write_backend_files(root)

    mcore = _mcore_model()
    poison(mcore)
    # RETURN_ALL: megatron-core checks the request against the checkpoint's metadata, drops what it
    # does not hold before reading, and returns both mismatches ("unexpected": asked for, not in the
    # checkpoint; "missing": in the checkpoint, not asked for).
    loaded, missing, unexpected = mcore_dist_checkpointing.load(
        mcore.sharded_state_dict(), root, strict=StrictHandling.RETURN_ALL
    )
    assert not missing, sorted(missing)
    # Only the ShardedObjects of megatron-core's ``_extra_state`` entries (Transformer Engine's
    # FP8 metadata; None in its local layers), which our layers do not have.
    assert unexpected and all(key.endswith("_extra_state") for key in unexpected), sorted(unexpected)
    assert loaded.pop("iteration") == 0  # common.pt's content comes back with the tensors
    result = mcore.load_state_dict(loaded, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(key.endswith("_extra_state") for key in result.missing_keys), result.missing_keys
    assert_same(tensors(mcore), tensors(ours))
    return _relative_logits_error(mcore, ours)


DIRECTIONS = {"mcore_to_ours": _megatron_core_writes_we_read, "ours_to_mcore": _we_write_megatron_core_reads}


def _both_ways(rank: int, world: int, roots: list[str]) -> dict:
    """Each direction's logits error, or the traceback that stopped it, so that the other direction
    still runs and each test reports its own. (The comparisons come after the collectives, so a
    failing comparison does not leave the other rank waiting.)"""
    results = {}
    for (name, fn), root in zip(DIRECTIONS.items(), roots):
        try:
            results[name] = fn(root)
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def interchange() -> list[dict]:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        return run_world(_both_ways, TP, [a, b])


def _check(per_rank: list[dict], direction: str) -> None:
    for rank, results in enumerate(per_rank):
        error = results[direction]
        assert not isinstance(error, str), f"rank {rank}:\n{error}"
        assert error <= 1e-5, f"rank {rank}: logits differ by {error:.3g} (relative)"


@pytest.mark.world
def test_megatron_core_checkpoint_loads_into_our_model(interchange):
    _check(interchange, "mcore_to_ours")


@pytest.mark.world
def test_our_checkpoint_loads_into_megatron_core(interchange):
    _check(interchange, "ours_to_mcore")
