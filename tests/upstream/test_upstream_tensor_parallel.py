"""tensor_parallel's upstream surface: layer constructors and return types, RNG tracker and seeding,
activation checkpointing, attribute helpers, mappings, broadcast_data and the vocab-parallel cross
entropy. Single-process checks use mocks or size-1 stand-in groups; collectives run in one gloo world."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_world

from megatron_lite.core import ModelParallelConfig, parallel_state, tensor_parallel
from megatron_lite.core.models.common.language_module.language_module import LanguageModule
from megatron_lite.core.tensor_parallel import cross_entropy as cross_entropy_module
from megatron_lite.core.tensor_parallel import mappings
from megatron_lite.core.tensor_parallel.random import (
    CudaRNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_lite.core.transformer.transformer_config import TransformerConfig


class _Group:
    """Stands in for a process group of one rank (what the mappings and losses ask of a group)."""

    def __init__(self, rank=0, size=1):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True, **kw
    )


def _arange_init(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return weight.copy_(torch.arange(weight.numel(), dtype=weight.dtype).view_as(weight) / weight.numel())


# Configs -----------------------------------------------------------------------------------------


def test_transformer_config_is_a_model_parallel_config_with_dtypes_that_follow_bf16():
    cfg = _config(perform_initialization=False)
    assert isinstance(cfg, ModelParallelConfig) and not cfg.perform_initialization
    assert cfg.params_dtype == torch.float32 and cfg.pipeline_dtype == torch.float32
    cfg.bf16 = True  # CLI overrides flip precision after construction
    assert cfg.params_dtype == torch.bfloat16 and cfg.pipeline_dtype == torch.bfloat16
    explicit = ModelParallelConfig(pipeline_model_parallel_size=4, pipeline_dtype=torch.float16)
    assert explicit.pipeline_dtype == torch.float16 and explicit.params_dtype == torch.float32
    # init_method defaults are upstream's, and the config still pickles (checkpoints store asdict).
    weight = cfg.init_method(torch.empty(1000))
    assert 0.015 < weight.std().item() < 0.025
    cfg.num_layers, cfg.init_method_std = 50, 1.0  # set after construction, as the CLI does
    assert 0.08 < cfg.output_layer_init_method(torch.empty(4000)).std().item() < 0.12  # 1 / sqrt(100)
    restored = pickle.loads(pickle.dumps(dataclasses.asdict(cfg)))
    assert restored["params_dtype"] == torch.bfloat16 and callable(restored["output_layer_init_method"])
    # Hooks the loop installs are attributes, not fields, so asdict never copies process groups.
    assert "finalize_model_grads_func" not in restored and cfg.finalize_model_grads_func is None


# Layers without tensor parallelism ---------------------------------------------------------------


def test_linear_layers_return_output_and_bias_as_upstream():
    cfg = _config()
    col = tensor_parallel.ColumnParallelLinear(8, 6, config=cfg, init_method=_arange_init, bias=True)
    x = torch.randn(3, 2, 8)
    out, bias = col(x)
    assert bias is None and torch.allclose(out, F.linear(x, col.weight, col.bias))
    skip = tensor_parallel.ColumnParallelLinear(
        8, 6, config=cfg, init_method=_arange_init, bias=True, skip_bias_add=True
    )
    out, bias = skip(x)
    assert bias is skip.bias and torch.allclose(out, F.linear(x, skip.weight))
    row = tensor_parallel.RowParallelLinear(
        6, 4, config=cfg, init_method=_arange_init, bias=True, input_is_parallel=True, skip_bias_add=False
    )
    assert row.weight.partition_dim == 1 and row.weight.tensor_model_parallel
    assert not hasattr(row.bias, "tensor_model_parallel")  # the bias is duplicated, not split
    with pytest.raises(TypeError):  # upstream makes bias / input_is_parallel / skip_bias_add required
        tensor_parallel.RowParallelLinear(6, 4, config=cfg, init_method=_arange_init, bias=True)
    with pytest.raises(RuntimeError, match="shape"):
        col(x, weight=torch.zeros(5, 8))


def test_expert_layers_are_reduced_over_the_expert_groups_when_those_differ():
    """is_expert: parameters marked allreduce=False when the expert data-parallel group is not the
    dense one (an expert-TP size of its own, or expert parallelism), as upstream."""

    def params(cfg):
        col = tensor_parallel.ColumnParallelLinear(8, 6, config=cfg, init_method=_arange_init, is_expert=True)
        row = tensor_parallel.RowParallelLinear(
            6, 8, config=cfg, init_method=_arange_init, bias=True, input_is_parallel=True,
            skip_bias_add=True, is_expert=True,
        )  # fmt: skip
        return [*col.parameters(), *row.parameters()]

    assert all(p.allreduce is False for p in params(_config(expert_tensor_parallel_size=2)))
    assert all(p.allreduce is False for p in params(_config(expert_model_parallel_size=2)))
    assert all(p.allreduce is True for p in params(_config()))  # expert dp = dense dp


def test_perform_initialization_false_sets_attributes_without_drawing():
    cfg = _config(perform_initialization=False)
    calls = []
    emb = tensor_parallel.VocabParallelEmbedding(16, 8, init_method=calls.append, config=cfg)
    assert calls == [] and emb.weight.partition_dim == 0 and emb.weight.partition_stride == 1
    assert emb.weight.device.type == "cpu"


def test_frozen_weight_gets_no_gradient_but_the_input_does():
    cfg = _config()
    col = tensor_parallel.ColumnParallelLinear(8, 4, config=cfg, init_method=_arange_init, bias=False)
    col.weight.requires_grad_(False)
    x = torch.randn(5, 8, requires_grad=True)
    col(x)[0].sum().backward()
    assert col.weight.grad is None
    assert torch.allclose(x.grad, col.weight.sum(0).expand(5, 8))


# Attribute helpers -------------------------------------------------------------------------------


def test_attribute_helpers():
    p = torch.nn.Parameter(torch.empty(2))
    tensor_parallel.set_tensor_model_parallel_attributes(p, True, 1, 2)
    with pytest.raises(AssertionError):
        tensor_parallel.set_tensor_model_parallel_attributes(p, True, 1, 2)
    p.is_qkv, p.qkv_split_shapes, p.pad_length = True, [4, 2, 2], 3
    q = torch.empty(2)
    tensor_parallel.copy_tensor_model_parallel_attributes(q, p)
    tensor_parallel.copy_gtp_attributes(q, p)
    assert (q.tensor_model_parallel, q.partition_dim, q.partition_stride) == (True, 1, 2)
    assert q.qkv_split_shapes == [4, 2, 2] and q.pad_length == 3
    r = torch.empty(1)
    tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(r)
    assert (r.tensor_model_parallel, r.partition_dim, r.is_qkv) == (False, -1, False)

    duplicate = torch.empty(1)
    assert tensor_parallel.param_is_not_tensor_parallel_duplicate(p, _Group(rank=1))  # split: always counts
    assert not tensor_parallel.param_is_not_tensor_parallel_duplicate(duplicate, _Group(rank=1))
    assert tensor_parallel.param_is_not_tensor_parallel_duplicate(duplicate, 0)  # a cached rank
    duplicate.allreduce = False  # expert topology: decided by the expert TP group
    assert tensor_parallel.param_is_not_tensor_parallel_duplicate(duplicate, _Group(1), _Group(0))


# RNG -------------------------------------------------------------------------------------------


def test_tracker_forks_advance_their_stream_and_nest():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 11)
    tracker.add("b", 22)
    with pytest.raises(RuntimeError, match="seed"):
        tracker.add("c", 11)
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("a", 33)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        a1 = torch.rand(3)
        with tracker.fork("b"):
            b1 = torch.rand(3)
        a2 = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    torch.manual_seed(11)
    assert torch.equal(torch.cat([a1, a2]), torch.rand(6))  # "a" continued across the inner fork
    torch.manual_seed(22)
    assert torch.equal(b1, torch.rand(3))
    snapshot = tracker.get_states()
    with tracker.fork("a"):
        torch.rand(1)
    assert not torch.equal(snapshot["a"], tracker.get_states()["a"])  # the snapshot was not mutated
    tracker.set_states({"x": 1})
    assert tracker.get_states() == {"x": 1}


def test_model_parallel_seed_streams():
    model_parallel_cuda_manual_seed(100, tp_rank=3, force_reset_rng=True)
    states = get_cuda_rng_tracker().get_states()
    assert set(states) == {"model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"}
    with get_cuda_rng_tracker().fork():
        drawn = torch.rand(4)
    torch.manual_seed(100 + 2718 + 3)
    assert torch.equal(drawn, torch.rand(4))
    with pytest.raises(NotImplementedError):
        model_parallel_cuda_manual_seed(1, te_rng_tracker=True)


def test_checkpoint_replays_dropout_and_matches_plain_backward():
    model_parallel_cuda_manual_seed(5, tp_rank=0)
    weight = torch.randn(6, 6, requires_grad=True)

    def block(x):
        with get_cuda_rng_tracker().fork():
            return F.dropout(x @ weight, p=0.5, training=True) + F.dropout(x, p=0.3, training=True)

    x = torch.randn(4, 6, requires_grad=True)
    states = get_cuda_rng_tracker().get_states()
    cpu = torch.get_rng_state()
    plain = block(x)
    plain.sum().backward()
    expected = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    get_cuda_rng_tracker().set_states(states)
    torch.set_rng_state(cpu)
    recomputed = checkpoint(block, False, x)
    assert not recomputed.grad_fn.__class__.__name__.startswith("Mul")  # no activations kept
    recomputed.sum().backward()
    assert torch.equal(plain, recomputed)
    assert torch.equal(x.grad, expected[0]) and torch.equal(weight.grad, expected[1])


# Losses and mappings with stand-in groups --------------------------------------------------------


def test_cross_entropy_reduces_over_the_given_group(mocker):
    group = _Group()
    all_reduce = mocker.patch("torch.distributed.all_reduce")
    mocker.patch.object(cross_entropy_module, "get_tensor_model_parallel_group", side_effect=AssertionError)
    logits, target = torch.randn(5, 7), torch.randint(0, 7, (5,))
    # Before the call, as upstream's test: fp32 logits become the softmax in place (megatron-core's memory).
    expected, softmax = F.cross_entropy(logits, target, reduction="none"), F.softmax(logits, -1)
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, tp_group=group)
    assert torch.allclose(loss, expected) and torch.allclose(logits, softmax)
    assert [c.kwargs["group"] for c in all_reduce.call_args_list] == [group] * 3
    with pytest.raises(NotImplementedError, match="label_smoothing"):
        tensor_parallel.vocab_parallel_cross_entropy(logits, target, 0.1)


def test_language_module_loss_is_batch_major():
    module = LanguageModule(_config())
    labels = torch.randint(0, 10, (2, 3))
    logits = torch.randn(3, 2, 10)
    expected = F.cross_entropy(logits.transpose(0, 1).reshape(6, 10), labels.reshape(6), reduction="none")
    loss = module.compute_language_model_loss(labels, logits)
    assert loss.shape == (2, 3) and torch.allclose(loss.reshape(6), expected)


def test_mappings_are_identities_on_one_rank():
    x = torch.randn(4, 6, requires_grad=True)
    group = _Group()
    for fn in (
        mappings.copy_to_tensor_model_parallel_region,
        mappings.reduce_from_tensor_model_parallel_region,
        mappings.scatter_to_tensor_model_parallel_region,
        mappings.gather_from_tensor_model_parallel_region,
        mappings.scatter_to_sequence_parallel_region,
        mappings.reduce_scatter_to_sequence_parallel_region,
    ):
        assert torch.equal(fn(x, group=group), x)
    assert torch.equal(mappings._GatherFromModelParallelRegion.symbolic(None, x, group), x)
    parts = tensor_parallel.split_tensor_along_last_dim(x, 3, contiguous_split_chunks=True)
    assert len(parts) == 3 and all(p.is_contiguous() and p.shape == (4, 2) for p in parts)
    assert tensor_parallel.VocabUtility.vocab_range_from_global_vocab_size(12, 2, 3) == (8, 12)


# Collectives in a real world ---------------------------------------------------------------------


def _tp_world(rank: int, world: int) -> bool:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = _config()
    torch.manual_seed(0)  # the same full tensors on every rank
    x = torch.randn(4, 3, 8)
    full_w = _arange_init(torch.empty(6, 8))

    # ColumnParallelLinear (tp_group None -> parallel_state's group): this rank's rows of the master.
    col = tensor_parallel.ColumnParallelLinear(8, 6, config=cfg, init_method=_arange_init, gather_output=True)
    assert torch.equal(col.weight, full_w.chunk(world)[rank])
    xc = x.clone().requires_grad_(True)
    out, _ = col(xc)
    assert torch.allclose(out, F.linear(x, full_w))
    out.sum().backward()  # the input gradient is all-reduced: every rank gets the full one
    assert torch.allclose(xc.grad, full_w.sum(0).expand_as(x))

    row = tensor_parallel.RowParallelLinear(
        8, 6, config=cfg, init_method=_arange_init, bias=False, input_is_parallel=False, skip_bias_add=False
    )
    assert torch.allclose(row(x)[0], F.linear(x, full_w), atol=1e-6)

    emb = tensor_parallel.VocabParallelEmbedding(6, 8, init_method=_arange_init, config=cfg)
    ids = torch.tensor([[0, 5, 3]])
    assert torch.allclose(emb(ids), F.embedding(ids, full_w))

    # Expert layers (expert TP = TP here): this rank's shard, no collective inside; the token
    # dispatcher gathers the tokens and reduces the outputs (upstream's explicit_expert_comm).
    ecol = tensor_parallel.ColumnParallelLinear(
        8, 6, config=cfg, init_method=_arange_init, bias=False, is_expert=True
    )
    assert ecol.explicit_expert_comm and ecol.tp_group is parallel_state.get_expert_tensor_parallel_group()
    xe = x.clone().requires_grad_(True)
    out, _ = ecol(xe)
    assert torch.allclose(out, F.linear(x, full_w.chunk(world)[rank]))
    out.sum().backward()  # not all-reduced: this shard's part of the input gradient only
    assert torch.allclose(xe.grad, full_w.chunk(world)[rank].sum(0).expand_as(x))
    erow = tensor_parallel.RowParallelLinear(
        8, 6, config=cfg, init_method=_arange_init, bias=True, input_is_parallel=True,
        skip_bias_add=True, is_expert=True,
    )  # fmt: skip
    part = x.chunk(world, dim=-1)[rank]
    out, bias = erow(part)
    assert bias is erow.bias and torch.allclose(out, F.linear(part, full_w.chunk(world, dim=1)[rank]))

    # Cross entropy over split logits equals the full one, with the full gradient slice.
    logits, target = torch.randn(5, 6), torch.randint(0, 6, (5,))
    local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    loss = tensor_parallel.vocab_parallel_cross_entropy(local, target)
    full = logits.clone().requires_grad_(True)
    F.cross_entropy(full, target, reduction="sum").backward()
    loss.sum().backward()
    assert torch.allclose(loss, F.cross_entropy(logits, target, reduction="none"), atol=1e-6)
    assert torch.allclose(local.grad, full.grad.chunk(world, dim=-1)[rank], atol=1e-6)

    # Sequence-parallel mappings: split/gather/reduce-scatter along the first dimension.
    seq = torch.arange(8.0).view(4, 2).requires_grad_(True)
    mine = tensor_parallel.scatter_to_sequence_parallel_region(seq)
    assert torch.equal(mine, seq.detach().chunk(world)[rank])
    assert torch.equal(tensor_parallel.gather_from_sequence_parallel_region(mine.detach()), seq.detach())
    assert torch.equal(tensor_parallel.reduce_scatter_to_sequence_parallel_region(seq.detach()), mine * world)
    mine.sum().backward()  # scatter's backward gathers every rank's slice of the gradient
    assert torch.equal(seq.grad, torch.ones(4, 2))

    # 1-D split/gather round trip, broadcast_data from TP rank 0, frozen-weight dgrad all-reduce.
    flat = torch.arange(12.0).view(3, 4)
    share = tensor_parallel.split_tensor_into_1d_equal_chunks(flat)
    assert torch.equal(tensor_parallel.gather_split_1d_tensor(share), flat.view(-1))
    data = {"tokens": torch.arange(6).view(2, 3) if rank == 0 else torch.zeros(1, dtype=torch.long)}
    got = tensor_parallel.broadcast_data(["tokens"], data, torch.long)
    assert torch.equal(got["tokens"], torch.arange(6).view(2, 3))
    inp = torch.eye(4, requires_grad=True)
    tensor_parallel.linear_with_frozen_weight(
        inp, torch.ones(2, 4), None, False, True, False
    ).sum().backward()
    assert torch.equal(inp.grad, torch.full((4, 4), 2.0 * world))

    # checkpoint with distributed saved activations: only this rank's share is kept until backward.
    a = torch.ones(4, 4, requires_grad=True)
    out = checkpoint(lambda u, v: u * v, True, a, torch.full((4, 4), 3.0))
    assert a.data.shape == (16 // world,)
    out.sum().backward()
    assert a.data.shape == (4, 4) and torch.equal(a.grad, torch.full((4, 4), 3.0))
    parallel_state.destroy_model_parallel()
    return dist.get_world_size()


@pytest.mark.world
def test_tensor_parallel_collectives():
    assert run_world(_tp_world, 2) == [2, 2]
