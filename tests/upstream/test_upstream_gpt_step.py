"""Megatron-Bridge's surface for the GPT step: forward_step(state, ...), the loop's state injection,
and GPTModelProvider.provide(pre_process=None, post_process=None, vp_stage=None)."""

from __future__ import annotations

import dataclasses
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from dist_helpers import run_world

from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.training import gpt_step
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.forward_step_func_types import (
    maybe_inject_state,
    needs_global_state_injection,
    prepare_forward_step_func,
)
from megatron_lite.training.state import GlobalState

# --- state injection ------------------------------------------------------------------------------


def _two_args(data_iterator, model):
    return "plain", data_iterator, model


def _state_first(state, data_iterator, model, return_schedule_plan=False):
    return state, data_iterator, model


def _annotated(s: GlobalState, data_iterator, model):
    return s, data_iterator, model


class _Functor:
    def __init__(self):
        self.calls = 0

    def __call__(self, global_state, data_iterator, model):
        self.calls += 1
        return global_state, data_iterator, model


def test_state_is_injected_only_where_wanted():
    state = object()
    assert prepare_forward_step_func(_two_args, state) is _two_args
    for fn in (_state_first, _annotated, gpt_step.forward_step):
        wrapped = prepare_forward_step_func(fn, state)
        assert isinstance(wrapped, partial) and wrapped.args == (state,)
    functor = _Functor()
    wrapped = prepare_forward_step_func(functor, state)
    assert wrapped("it", "m") == (state, "it", "m") and functor.calls == 1  # the functor keeps its state
    # Preparing twice (train() then evaluate()) does not inject the state a second time.
    assert prepare_forward_step_func(wrapped, state) is wrapped
    assert maybe_inject_state(_state_first, state, needs_injection=False) is _state_first
    assert not needs_global_state_injection(lambda data_iterator, model: None)


# --- forward_step ------------------------------------------------------------------------------------


class _FakeGPT(torch.nn.Module):
    """Records what forward_step passes; returns per-token 'losses' equal to the labels."""

    def __init__(self, cp_rank=0, cp_size=1):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.pg_collection = ProcessGroupCollection(
            cp=SimpleNamespace(rank=lambda: cp_rank, size=lambda: cp_size)
        )
        self.kwargs = None

    def forward(self, **kwargs):
        self.kwargs = kwargs
        return kwargs["labels"].float() * self.w


def _batch(seq=8):
    positions = torch.arange(seq).unsqueeze(0)
    return {
        "tokens": positions + 100,
        "labels": positions.float(),
        "loss_mask": torch.ones(1, seq),
        "position_ids": positions,
    }


def _state():
    return GlobalState(ConfigContainer())


def test_forward_step_returns_output_and_loss_partial():
    model = _FakeGPT()
    output, loss_fn = gpt_step.forward_step(_state(), iter([_batch()]), model)
    assert set(model.kwargs) == {"input_ids", "position_ids", "attention_mask", "labels"}
    assert (
        torch.equal(model.kwargs["input_ids"], _batch()["tokens"]) and model.kwargs["attention_mask"] is None
    )
    assert isinstance(loss_fn, partial) and loss_fn.func is gpt_step.loss_func
    loss, num_tokens, report = loss_fn(output)
    assert loss.item() == sum(range(8)) and num_tokens.item() == 8 and num_tokens.dtype == torch.int
    assert report["lm loss"].item() == pytest.approx(sum(range(8)) / 8)
    loss /= 2  # the schedule scales the loss in place; the report is its own tensor
    assert report["lm loss"].item() == pytest.approx(3.5)


def test_forward_step_slices_the_batch_to_this_cp_rank():
    model = _FakeGPT(cp_rank=1, cp_size=2)
    gpt_step.forward_step(_state(), iter([_batch(8)]), model)
    # Load-balanced split of 2 x 2 chunks: rank 1 holds chunks 1 and 2.
    assert model.kwargs["position_ids"].tolist() == [[2, 3, 4, 5]]


def _pp(stage, stages):
    return SimpleNamespace(rank=lambda: stage, size=lambda: stages)


def test_get_batch_reads_nothing_on_a_middle_pipeline_stage():
    data = iter([_batch(), _batch()])
    for stage in (1, 2):  # of four: neither embeds nor computes the loss
        groups = ProcessGroupCollection(pp=_pp(stage, 4))
        assert gpt_step.get_batch(data, pg_collection=groups) == (None,) * 6
    assert len(list(data)) == 2  # no batch was consumed
    for stage in (0, 3):
        data = iter([_batch()])
        tokens, labels, *_ = gpt_step.get_batch(data, pg_collection=ProcessGroupCollection(pp=_pp(stage, 4)))
        assert torch.equal(tokens, _batch()["tokens"]) and torch.equal(labels, _batch()["labels"])


def test_forward_step_refuses_a_schedule_plan():
    with pytest.raises(NotImplementedError, match="schedule_plan"):
        gpt_step.forward_step(_state(), iter([_batch()]), _FakeGPT(), return_schedule_plan=True)


# --- GPTModelProvider.provide ----------------------------------------------------------------


def _provider(**kw):
    return GPTModelProvider(
        **{"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "vocab_size": 64, **kw}
    )


def _stage_parts(stage, stages):
    cfg = _provider(num_layers=2 * stages, pipeline_model_parallel_size=stages)
    cfg._pg_collection = ProcessGroupCollection(pp=SimpleNamespace(rank=lambda: stage, size=lambda: stages))
    model = cfg.provide()
    return model.pre_process, model.post_process, hasattr(model, "embedding"), hasattr(model, "output_layer")


def test_provide_decides_the_stage_from_the_pipeline_group():
    assert _stage_parts(0, 1) == (True, True, True, True)
    assert _stage_parts(0, 2) == (True, False, True, False)
    assert _stage_parts(1, 2) == (False, True, False, True)
    assert _stage_parts(1, 3) == (False, False, False, False)


def test_provide_explicit_flags_and_refusals():
    cfg = _provider()
    cfg._pg_collection = ProcessGroupCollection(pp=SimpleNamespace(rank=lambda: 0, size=lambda: 2))
    model = cfg.provide(pre_process=True, post_process=True, vp_stage=0)
    assert model.pre_process and model.post_process
    assert model.pg_collection is cfg._pg_collection  # the forward step finds the groups here
    with pytest.raises(AssertionError, match="vp_stage"):
        cfg.provide(vp_stage=1)
    chunked = _provider(virtual_pipeline_model_parallel_size=2)
    chunked._pg_collection = cfg._pg_collection
    second = chunked.provide(vp_stage=1)  # chunk 1 of the first of two stages: no embedding, no loss
    assert not second.pre_process and not second.post_process
    # Groups are not a dataclass field: the config still serialises into checkpoints.
    assert "_pg_collection" not in dataclasses.asdict(cfg)
    assert cfg.deallocate_pipeline_outputs  # the 1F1B activation bound, as Megatron-Bridge


def test_provide_init_seed_sets_the_weights():
    cfg = _provider()
    cfg._pg_collection = ProcessGroupCollection(pp=SimpleNamespace(rank=lambda: 0, size=lambda: 1))
    a = cfg.provide().embedding.word_embeddings.weight
    b = cfg.provide().embedding.word_embeddings.weight
    cfg.init_seed = 7
    c = cfg.provide().embedding.word_embeddings.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


# --- the real thing: our step through the schedule, one process -------------------------------------


def _step_through_schedule(rank, world):
    from megatron_lite.core import parallel_state as ps
    from megatron_lite.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron_lite.core.pipeline_parallel import get_forward_backward_func

    ps.initialize_model_parallel()
    cfg = _provider()
    model = DistributedDataParallel(cfg, cfg.provide(), dp_group=ps.get_data_parallel_group())
    cfg.finalize_model_grads_func = finalize_model_grads
    batches = [_batch(16) for _ in range(2)]
    for i, b in enumerate(batches):
        b["tokens"] = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(i))
        b["labels"] = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(10 + i))
    store = get_forward_backward_func()(
        forward_step_func=prepare_forward_step_func(gpt_step.forward_step, _state()),
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=2,
        seq_length=16,
        micro_batch_size=1,
    )
    scheduled = torch.cat([p.main_grad.flatten() for p in model.parameters()]).clone()
    reported = [d["lm loss"].item() for d in store]
    model.zero_grad_buffer()
    manual = []
    for b in batches:
        loss = model(b["tokens"], b["position_ids"], labels=b["labels"]).mean()
        (loss / 2).backward()
        manual.append(loss.item())
    by_hand = torch.cat([p.main_grad.flatten() for p in model.parameters()])
    ps.destroy_model_parallel()
    return reported, manual, torch.allclose(scheduled, by_hand, atol=1e-7)


@pytest.mark.world
def test_our_step_through_the_schedule_matches_the_step_mean():
    reported, manual, grads_match = run_world(_step_through_schedule, 1)[0]
    assert reported == pytest.approx(manual, abs=1e-6) and grads_match
