"""A ``torch_dist`` checkpoint interchanges with megatron-core's own ``dist_checkpointing``, both ways,
in a real two-rank gloo world at tensor parallelism 2 (each TP rank writes its own shards and reads
them back through the other framework's mapping): megatron-core saves its GPTModel's
``sharded_state_dict()`` and ``torch_dist.sharded_pieces`` reads it into our GPTModel; our pieces are
saved and megatron-core's ``load`` reads them into its GPTModel. Llama-shaped (RMSNorm, SwiGLU, GQA,
untied embeddings, no biases), so the group-major QKV rows and the ``[gate; up]`` fc1 layout are
exercised. Every tensor must equal bitwise the same-named state-dict entry of the other framework at
the same TP rank, and both models must give the same logits (the tensors mean the same thing).

megatron-core (the dev extra's oracle) runs on the CPU here with a few CUDA calls replaced, each named
where it is replaced. Both directions run in one world: importing megatron-core costs each rank
seconds, and its save spawns a results-queue manager process once per rank."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import traceback
import zlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_world

from megatron_lite.core import dist_checkpointing, parallel_state
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.training.checkpointing.sharded_pieces import sharded_pieces
from megatron_lite.training.checkpointing.torch_dist import SHARDED_BACKEND

TP = 2
LAYERS, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB, SEQ = 2, 64, 8, 4, 8, 96, 256, 16
_LLAMA = dict(
    num_layers=LAYERS,
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_query_groups=GROUPS,  # 2 query heads per group, 2 groups per TP rank
    kv_channels=HEAD_DIM,
    ffn_hidden_size=FFN,
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    gated_linear_unit=True,
    activation_func=F.silu,
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    tensor_model_parallel_size=TP,
)


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


def _randomize(model, is_tp_split) -> None:
    """Random values in every parameter (norms too, not their ones), seeded by name and, for a tensor
    split over TP, by TP rank: a replicated tensor is the same on both ranks, as in training."""
    tp_rank = dist.get_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            seed = zlib.crc32(name.encode()) + (1000 * tp_rank if is_tp_split(name, param) else 0)
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))


def _poison(model) -> None:
    """NaN everywhere, so a tensor the load does not reach fails the comparison."""
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))


def _tensors(model) -> dict[str, torch.Tensor]:
    """The state dict without megatron-core's ``_extra_state`` entries: its local layers keep them
    (None) only for Transformer Engine compatibility; ours have none."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _assert_same(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype and value.shape == theirs[key].shape, key
        assert torch.equal(value, theirs[key]), key


def _relative_logits_error(mcore, ours) -> float:
    """Max relative difference of this rank's logits (its vocabulary slice) on the same tokens."""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).expand_as(tokens)
    # megatron-core's forward on the CPU: its RoPE moves the frequencies to
    # ``torch.cuda.current_device()`` on the first call (rotary_pos_embedding.py,
    # RotaryEmbedding.get_emb), here "cpu"; its default causal mask is built on "cuda"
    # (transformer/utils.py, get_default_causal_mask), so the mask is passed (True: masked out); its
    # attention forks the CUDA RNG tracker for dropout (dot_product_attention.py,
    # DotProductAttention.forward), which needs CUDA generators: the dropout is 0, so a fork that
    # keeps the current generator changes nothing.
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    no_fork = mock.Mock(fork=contextlib.nullcontext)
    with (
        torch.no_grad(),
        mock.patch("torch.cuda.current_device", lambda: "cpu"),
        mock.patch("megatron.core.tensor_parallel.get_cuda_rng_tracker", lambda: no_fork),
    ):
        theirs = mcore(tokens, positions, causal)  # [b, s, v / tp]
        mine = ours(tokens, positions).transpose(0, 1)  # [s, b, v / tp] -> [b, s, v / tp]
    assert mine.shape == theirs.shape == (2, SEQ, VOCAB // TP)
    return ((mine - theirs).abs().max() / theirs.abs().max()).item()


def _megatron_core_writes_we_read(root: str) -> float:
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing

    mcore = _mcore_model()
    _randomize(mcore, lambda _, param: getattr(param, "tensor_model_parallel", False))
    # The two CUDA calls of megatron-core's save on the CPU: ``torch.cuda.synchronize()`` after
    # copying the tensors to host memory (strategies/filesystem_async.py,
    # FileSystemWriterAsync.preload_tensors, unconditionally) and ``torch.cuda.current_device()`` as
    # the device of an all-reduce (strategies/state_dict_saver.py,
    # save_state_dict_async_finalize), which gloo does on the CPU. unittest.mock, not pytest-mock's
    # ``mocker``: this runs in a rank forked by run_world, where pytest's fixtures are not.
    with (
        mock.patch("torch.cuda.synchronize", lambda *args, **kwargs: None),
        mock.patch("torch.cuda.current_device", lambda: "cpu"),
    ):
        mcore_dist_checkpointing.save(mcore.sharded_state_dict(), root)
    with open(os.path.join(root, "metadata.json")) as f:
        assert json.load(f) == SHARDED_BACKEND  # what save_distributed writes, and load checks for

    ours, provider = _our_model()
    _poison(ours)
    pieces = _our_pieces(ours, provider)
    assert dist_checkpointing.missing_or_mismatched(pieces, dist_checkpointing.load_metadata(root)) == []
    with torch.no_grad():
        dist_checkpointing.load(pieces, root)
    _assert_same(_tensors(ours), _tensors(mcore))
    return _relative_logits_error(mcore, ours)


def _we_write_megatron_core_reads(root: str) -> float:
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_lite.core.models.gpt.state_dict_sharding import tp_split_dim

    ours, provider = _our_model()
    _randomize(ours, lambda name, _: tp_split_dim(name) is not None)
    dist_checkpointing.save(_our_pieces(ours, provider), root)
    if dist.get_rank() == 0:
        # What save_distributed adds to the DCP files: megatron-core's metadata.json, which its load
        # reads the strategies from, and a common.pt, which it loads first and merges the tensors
        # into (any dict; save_distributed's holds the iteration, config, RNG states ...).
        with open(os.path.join(root, "metadata.json"), "w") as f:
            json.dump(SHARDED_BACKEND, f)
        torch.save({"iteration": 0}, os.path.join(root, "common.pt"))
    dist.barrier()

    mcore = _mcore_model()
    _poison(mcore)
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
    _assert_same(_tensors(mcore), _tensors(ours))
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


def test_megatron_core_checkpoint_loads_into_our_model(interchange):
    _check(interchange, "mcore_to_ours")


def test_our_checkpoint_loads_into_megatron_core(interchange):
    _check(interchange, "ours_to_mcore")
