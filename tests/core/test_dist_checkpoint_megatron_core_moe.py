"""A mixture-of-experts ``torch_dist`` checkpoint interchanges with megatron-core's own
``dist_checkpointing``, both ways, in a real two-rank gloo world at expert parallelism 2 (each rank
holds two of the four experts): ours saved and read into megatron-core's GPTModel (its local spec:
``SequentialMLP`` experts, the allgather dispatcher, a gated shared expert), and megatron-core's saved
and read into ours. Twice: every layer MoE (the layers stacked on one axis) and dense and MoE layers
mixed by ``moe_layer_freq`` (upstream's non-homogeneous layers, one key per layer). Every tensor must
equal bitwise the same-named entry of the other framework on the same rank, and both models must give
the same logits.

One key differs between megatron-core's own specs: a MoE layer's ``pre_mlp_layernorm`` is saved under
that name by its Transformer Engine spec (the MoE layer has no fused ``linear_fc1`` to carry it) but
renamed ``mlp.linear_fc1.layer_norm_`` by its local spec's key map, which 0.16.1 applies to MoE layers
too. Our checkpoints use the Transformer Engine spec's name (that of the GPU runs' checkpoints), so the
local spec's MoE layers are given that spec's keys here (``_te_keys``)."""

from __future__ import annotations

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
from megatron_lite.core.models.gpt.expert_sharding import routed_expert
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.training.checkpointing.sharded_pieces import sharded_pieces

pytestmark = pytest.mark.world  # every test here starts processes

EP, EXPERTS, VOCAB, SEQ = 2, 4, 256, 16
_MOE = dict(
    **SMALL_LLAMA,
    num_moe_experts=EXPERTS,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_token_dispatcher_type="allgather",  # megatron-core's alltoall one makes a CUDA stream
    moe_shared_expert_intermediate_size=48,
    moe_shared_expert_gate=True,
    expert_model_parallel_size=EP,
)
LAYOUTS = {"all_moe": 1, "mixed": [1, 0]}  # moe_layer_freq: layer 0 MoE, layer 1 dense


def _te_keys(layer_spec) -> None:
    """A local MoE layer spec with the Transformer Engine spec's checkpoint keys (module docstring)."""
    layer_spec.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)


def _mcore_model(freq):
    from megatron.core import parallel_state as mcore_parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not mcore_parallel_state.model_parallel_is_initialized():
        mcore_parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    config = TransformerConfig(**_MOE, moe_layer_freq=freq, use_cpu_initialization=True)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer_spec in spec.layer_specs:
        if layer_spec.submodules.mlp.module is MoELayer:
            _te_keys(layer_spec)
    model = GPTModel(
        config, spec, VOCAB, SEQ, share_embeddings_and_output_weights=False, position_embedding_type="rope"
    )
    return model.eval()


def _our_model(freq):
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    provider = GPTModelProvider(
        **_MOE,
        moe_layer_freq=freq,
        vocab_size=VOCAB,
        seq_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    return provider.provide().eval(), provider


def _is_routed_expert(name, _param) -> bool:
    return routed_expert(name) is not None  # the only tensors that differ between the EP ranks


def _relative_logits_error(mcore, ours) -> float:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).expand_as(tokens)
    with mcore_forward_on_cpu():
        theirs = mcore(tokens, positions, causal_mask(SEQ))  # [b, s, v]
        mine = ours(tokens, positions).transpose(0, 1)  # [s, b, v] -> [b, s, v]
    assert mine.shape == theirs.shape == (2, SEQ, VOCAB)
    return ((mine - theirs).abs().max() / theirs.abs().max()).item()


def _megatron_core_writes_we_read(root: str, freq) -> float:
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing

    mcore = _mcore_model(freq)
    randomize(mcore, _is_routed_expert, dist.get_rank())
    with mcore_save_on_cpu():
        mcore_dist_checkpointing.save(mcore.sharded_state_dict(), root)
    ours, provider = _our_model(freq)
    poison(ours)
    pieces = sharded_pieces(ours, None, provider, with_optimizer=False)
    assert dist_checkpointing.missing_or_mismatched(pieces, dist_checkpointing.load_metadata(root)) == []
    with torch.no_grad():
        dist_checkpointing.load(pieces, root)
    assert_same(tensors(ours), tensors(mcore))
    return _relative_logits_error(mcore, ours)


def _we_write_megatron_core_reads(root: str, freq) -> float:
    from megatron.core import dist_checkpointing as mcore_dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    ours, provider = _our_model(freq)
    randomize(ours, _is_routed_expert, dist.get_rank())
    dist_checkpointing.save(sharded_pieces(ours, None, provider, with_optimizer=False), root)
    write_backend_files(root)
    mcore = _mcore_model(freq)
    poison(mcore)
    loaded, missing, unexpected = mcore_dist_checkpointing.load(
        mcore.sharded_state_dict(), root, strict=StrictHandling.RETURN_ALL
    )
    assert not missing, sorted(missing)
    assert all(key.endswith("_extra_state") for key in unexpected), sorted(unexpected)
    assert loaded.pop("iteration") == 0
    result = mcore.load_state_dict(loaded, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(key.endswith("_extra_state") for key in result.missing_keys), result.missing_keys
    assert_same(tensors(mcore), tensors(ours))
    return _relative_logits_error(mcore, ours)


DIRECTIONS = {"mcore_to_ours": _megatron_core_writes_we_read, "ours_to_mcore": _we_write_megatron_core_reads}


def _every_case(rank: int, world: int, base: str) -> dict:
    """Each (layout, direction)'s logits error, or the traceback that stopped it (the comparisons come
    after the collectives, so a failing one does not leave the other rank waiting)."""
    results = {}
    for layout, freq in LAYOUTS.items():
        for direction, fn in DIRECTIONS.items():
            root = os.path.join(base, f"{layout}-{direction}")
            os.makedirs(root, exist_ok=True)
            try:
                results[layout, direction] = fn(root, freq)
            except Exception:
                results[layout, direction] = traceback.format_exc()
            dist.barrier()
    return results


@pytest.fixture(scope="module")
def interchange() -> list[dict]:
    with tempfile.TemporaryDirectory() as base:
        return run_world(_every_case, EP, base)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_checkpoint_interchanges_with_megatron_core(interchange, layout, direction):
    for rank, results in enumerate(interchange):
        error = results[layout, direction]
        assert not isinstance(error, str), f"rank {rank}:\n{error}"
        assert error <= 1e-5, f"rank {rank}: logits differ by {error:.3g} (relative)"
