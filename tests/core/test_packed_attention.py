"""The packing invariant at the model level: in one packed row (PackedSeqParams, upstream's thd
format) every example gets the per-token losses and the gradients it gets run alone, with RoPE
restarting at each example, grouped-query attention, padded examples (Bridge's padding rule),
selective and full recomputation; and on a two-rank world at tp 2, sequence parallelism and context
parallelism 2 (each example padded to a multiple of 2 cp, split as megatron-core's
get_thd_batch_on_this_cp_rank). Packed attention builds no [s, s] mask: it saves no more than the
same row unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_world
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lite.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
from megatron_lite.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron_lite.core.models.gpt.gpt_model import GPTModel
from megatron_lite.core.packed_seq_params import (
    PackedSeqParams,
    check_cp_divisible,
    thd_partitioned_indices,
    thd_position_ids,
)
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.utils import get_batch_on_this_cp_rank, get_thd_batch_on_this_cp_rank
from megatron_lite.training.memory.saved_tensors import ActivationMemoryTracker

VOCAB = 64
LENGTHS = [5, 11, 3, 9]  # real tokens of each example (inputs; labels are the next tokens)


def _examples(lengths=LENGTHS):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB, (n + 1,), generator=g) for n in lengths]


def _loss_mask(n: int) -> torch.Tensor:
    return (torch.arange(n) >= n // 3).float()  # the first third a prompt: no loss there


def _pack(examples, seq: int, multiple: int = 1, close_tail: bool = True):
    """One packed row with the contract's keys: each example padded to ``multiple`` (its padding
    masked, Bridge's rule), a masked pad tail to ``seq``; cu_seqlens with Megatron-LM's -1 fill."""
    parts = {"tokens": [], "labels": [], "loss_mask": [], "position_ids": []}
    cu, cu_padded = [0], [0]
    for e in examples:
        n = e.numel() - 1
        pad = -(-n // multiple) * multiple - n
        parts["tokens"].append(F.pad(e[:-1], (0, pad)))
        parts["labels"].append(F.pad(e[1:], (0, pad)))
        parts["loss_mask"].append(F.pad(_loss_mask(n), (0, pad)))
        parts["position_ids"].append(torch.arange(n + pad))
        cu.append(cu_padded[-1] + n)
        cu_padded.append(cu_padded[-1] + n + pad)
    tail = seq - cu_padded[-1]
    for key in ("tokens", "labels", "loss_mask"):
        parts[key].append(torch.zeros(tail, dtype=parts[key][0].dtype))
    parts["position_ids"].append(torch.arange(tail))
    if close_tail:  # the pad tail as its own example (else it is implied by the row's length)
        cu.append(seq)
        cu_padded.append(seq)
    batch = {k: torch.cat(v)[None] for k, v in parts.items()}
    fill = [-1] * 3
    cu_t, cu_padded_t = (torch.tensor(c + fill, dtype=torch.int32) for c in (cu, cu_padded))
    batch["cu_seqlens"] = cu_padded_t
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_t,
        cu_seqlens_kv=cu_t,
        cu_seqlens_q_padded=cu_padded_t if multiple > 1 else None,
        cu_seqlens_kv_padded=cu_padded_t if multiple > 1 else None,
        max_seqlen_q=max(LENGTHS),
        max_seqlen_kv=max(LENGTHS),
    )
    return batch, params, cu_padded[:-1] if close_tail else cu_padded


def _config(**kwargs):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2)
    return TransformerConfig(use_cpu_initialization=True, **{**base, **kwargs})


def _example_loss(loss, mask, weight):
    return weight * (loss * mask).sum() / mask.sum()


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_and_alone(model, examples, batch, params, starts):
    """Per-example (loss, gradients) from the packed row and from each example alone."""
    packed, alone = [], []
    for i, e in enumerate(examples):
        n = e.numel() - 1
        model.zero_grad()
        loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], packed_seq_params=params)
        a = starts[i]
        example = _example_loss(loss[0, a : a + n], batch["loss_mask"][0, a : a + n], 1.0)
        example.backward()
        packed.append((loss[0, a : a + n].detach(), _grads(model)))
        model.zero_grad()
        loss = model(e[:-1][None], torch.arange(n)[None], labels=e[1:][None])
        _example_loss(loss[0], _loss_mask(n), 1.0).backward()
        alone.append((loss[0].detach(), _grads(model)))
    return packed, alone


@pytest.mark.parametrize(
    "case",
    [
        dict(rope=True, multiple=1, close_tail=False, config={}),
        dict(
            rope=True,
            multiple=4,
            close_tail=True,
            config=dict(
                rotary_interleaved=True,
                recompute_granularity="selective",
                recompute_modules=["core_attn", "mlp"],
            ),
            rotary_percent=0.5,
        ),
        dict(
            rope=False,
            multiple=1,
            close_tail=True,
            config=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        ),
    ],
    ids=["rope_gqa", "padded_selective_recompute", "learned_full_recompute"],
)
def test_each_example_of_a_packed_row_gets_its_own_losses_and_gradients(case):
    examples = _examples()
    model = GPTModel(
        _config(**case["config"]),
        VOCAB,
        64,
        position_embedding_type="rope" if case["rope"] else "learned_absolute",
        rotary_percent=case.get("rotary_percent", 1.0),
    )
    batch, params, starts = _pack(examples, 48, case["multiple"], case["close_tail"])
    packed, alone = _packed_and_alone(model, examples, batch, params, starts)
    for (loss_p, grads_p), (loss_a, grads_a) in zip(packed, alone, strict=True):
        torch.testing.assert_close(loss_p, loss_a, rtol=0, atol=1e-5)
        assert grads_p.keys() == grads_a.keys()
        for name, g in grads_a.items():
            torch.testing.assert_close(grads_p[name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_rotary_positions_restart_at_each_example_in_both_thd_shapes():
    config = _config()
    cu = torch.tensor([0, 3, 8, 8, 10, -1], dtype=torch.int32)
    assert thd_position_ids(cu, 12).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1]
    freqs = torch.rand(6, 1, 1, 8)
    t = torch.randn(12, 1, 2, 8)
    rotated = apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu)
    for a, b in ((0, 3), (3, 8), (8, 10), (10, 12)):
        alone = apply_rotary_pos_emb(t[a:b], freqs[: b - a], config)
        torch.testing.assert_close(rotated[a:b], alone, rtol=0, atol=0)
    thd = apply_rotary_pos_emb(t[:, 0], freqs, config, cu_seqlens=cu)  # upstream's [t, heads, d]
    torch.testing.assert_close(thd, rotated[:, 0], rtol=0, atol=0)


def test_thd_cp_split_takes_chunks_r_and_2cp_minus_1_minus_r_of_every_example():
    batch = {"tokens": torch.arange(16)[None], "cu_seqlens": torch.tensor([[0, 8, 12, 16, -1]])}
    shares = [
        get_thd_batch_on_this_cp_rank(dict(batch), batch["cu_seqlens"], None, torch.tensor([8]), 2, r)
        for r in (0, 1)
    ]
    assert shares[0][0]["tokens"].tolist() == [[0, 1, 6, 7, 8, 11, 12, 15]]
    assert shares[1][0]["tokens"].tolist() == [[2, 3, 4, 5, 9, 10, 13, 14]]
    assert torch.equal(shares[1][0]["cu_seqlens"], batch["cu_seqlens"])  # boundaries stay global
    assert shares[0][1].qkv_format == "thd" and shares[0][1].max_seqlen_q == 8
    with pytest.raises(ValueError, match="packed example 1 is 6 tokens long.*multiple of 4"):
        check_cp_divisible([0, 8, 14, 16], 2)


def test_packed_rows_need_micro_batch_size_one():
    model = GPTModel(_config(), VOCAB, 16, position_embedding_type="rope")
    _, params, _ = _pack(_examples([3, 5]), 16)
    with pytest.raises(ValueError, match="--micro-batch-size 1"):
        model(torch.zeros(2, 16, dtype=torch.long), None, packed_seq_params=params)


def test_a_packed_forward_reads_its_boundaries_on_the_host_under_fake_tensors():
    """The dry run's fake tensors have no values: the boundaries (real host tensors) are read before
    any torch op on them."""
    model = GPTModel(_config(recompute_granularity="selective"), VOCAB, 48, position_embedding_type="rope")
    batch, params, _ = _pack(_examples(), 48, 2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], packed_seq_params=params)
        loss.sum().backward()
    assert loss.shape == (1, 48)


def test_packed_attention_saves_no_more_than_the_row_unpacked():
    """With attention dropout the CPU keeps the softmax probabilities: sum(s_i^2) of them for a
    packed row against s^2 unpacked, and no block mask of the row's shape."""
    model_parallel_cuda_manual_seed(5, tp_rank=0, force_reset_rng=True)  # attention dropout's stream
    model = GPTModel(_config(attention_dropout=0.1), VOCAB, 64, position_embedding_type="rope")
    batch, params, _ = _pack(_examples([20, 12, 24]), 64)
    peaks = []
    for p in (None, params):
        tracker = ActivationMemoryTracker()
        tracker.exclude_parameters(model.parameters())
        with tracker.track():
            model(batch["tokens"], batch["position_ids"], labels=batch["labels"], packed_seq_params=p).sum()
        peaks.append(tracker.peak_bytes)
    # The math path's three float32 [heads, s, s] tensors (softmax, dropout mask, dropped copy) of 2
    # layers x 4 heads: 64^2 scores each unpacked, 20^2 + 12^2 + 24^2 + 8^2 (the pad tail) packed;
    # everything else alike.
    scores_fewer = 2 * 4 * (64**2 - (20**2 + 12**2 + 24**2 + 8**2))
    assert peaks[0] - peaks[1] == 3 * 4 * scores_fewer, peaks


# A two-rank world: tp 2, tp 2 with sequence parallelism (and full recompute), cp 2 (and selective).
_LAYOUTS = [
    dict(tp=True, config={}),
    dict(
        tp=True,
        config=dict(
            sequence_parallel=True,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        ),
    ),
    dict(tp=False, config=dict(context_parallel_size=2, recompute_granularity="selective")),
]


def _world_losses_and_grads(model, examples, batch, params, starts, cp, cp_rank):
    """Per-example losses (whole, summed over CP ranks) and the gradients of a weighted sum of them,
    from the packed row and from the examples one by one (each padded as in the row)."""
    weights = [1.0, 0.5, 2.0, 0.25]
    total = batch["tokens"].size(1)
    local = batch
    if cp > 1:
        local, params = get_thd_batch_on_this_cp_rank(
            dict(batch), params.cu_seqlens_q, params.cu_seqlens_q_padded, torch.tensor([11]), cp, cp_rank
        )
    model.zero_grad()
    loss = model(local["tokens"], local["position_ids"], labels=local["labels"], packed_seq_params=params)
    # Which example each local token belongs to: its global index against the boundaries.
    index = thd_partitioned_indices(batch["cu_seqlens"], total, cp, cp_rank)
    packed_losses, objective = [], 0.0
    for i, e in enumerate(examples):
        n, a = e.numel() - 1, starts[i]
        mine = ((index >= a) & (index < a + n)).float() * local["loss_mask"][0]
        part = (loss[0] * mine).sum() / _loss_mask(n).sum()
        objective = objective + weights[i] * part
        packed_losses.append(part.detach())
    objective.backward()
    packed = (torch.stack(packed_losses), _grads(model))
    model.zero_grad()
    alone_losses = []
    for i, e in enumerate(examples):
        n = e.numel() - 1
        padded = -(-n // (2 * cp)) * (2 * cp)
        one = {
            "tokens": F.pad(e[:-1], (0, padded - n))[None],
            "labels": F.pad(e[1:], (0, padded - n))[None],
            "loss_mask": F.pad(_loss_mask(n), (0, padded - n))[None],
            "position_ids": torch.arange(padded)[None],
        }
        one = get_batch_on_this_cp_rank(one, cp_rank, cp)
        loss = model(one["tokens"], one["position_ids"], labels=one["labels"])
        part = (loss[0] * one["loss_mask"][0]).sum() / _loss_mask(n).sum()
        (weights[i] * part).backward()
        alone_losses.append(part.detach())
    return packed, (torch.stack(alone_losses), _grads(model))


def _reduce(result, model, layout, tp, cp):
    losses, grads = result
    if cp is not None:
        dist.all_reduce(losses, group=cp)
        for g in grads.values():
            dist.all_reduce(g, group=cp)
    if layout["config"].get("sequence_parallel"):
        for name, p in model.named_parameters():
            p.main_grad = grads[name]
        _allreduce_non_tensor_model_parallel_grads([model], tp)
    return losses, grads


def _packed_in_world(rank: int, world: int) -> list:
    group = dist.new_group(list(range(world)))
    examples = _examples()
    errors = []
    for layout in _LAYOUTS:
        cp = None if layout["tp"] else group
        tp = group if layout["tp"] else None
        config = _config(tensor_model_parallel_size=world if tp else 1, **layout["config"])
        model = GPTModel(
            config,
            VOCAB,
            64,
            position_embedding_type="rope",
            pg_collection=ProcessGroupCollection(tp=tp, cp=cp),
        )
        cp_size = 1 if cp is None else world
        batch, params, starts = _pack(examples, 48, 2 * cp_size)
        packed, alone = _world_losses_and_grads(
            model, examples, batch, params, starts, cp_size, rank if cp else 0
        )
        (loss_p, grads_p), (loss_a, grads_a) = (_reduce(r, model, layout, tp, cp) for r in (packed, alone))
        grad_error = max((grads_p[n] - g).abs().max().item() for n, g in grads_a.items())
        errors.append(((loss_p - loss_a).abs().max().item(), grad_error, grads_p.keys() == grads_a.keys()))
    return errors


@pytest.mark.world
def test_packing_invariant_at_tp2_sequence_parallel_and_cp2():
    for errors in run_world(_packed_in_world, 2):
        for layout, (loss_error, grad_error, same_params) in zip(_LAYOUTS, errors, strict=True):
            assert same_params and loss_error <= 1e-5 and grad_error <= 1e-5, (layout, errors)
