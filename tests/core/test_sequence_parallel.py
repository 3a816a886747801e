"""Sequence parallelism computes what tensor parallelism alone computes: the same loss and the same
gradients for every parameter, on a real two-rank gloo world; and its column-parallel linears keep only
their sequence shard for backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_world

from megatron_lite.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
from megatron_lite.core.models.gpt.gpt_model import GPTModel
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.training.memory.saved_tensors import ActivationMemoryTracker

pytestmark = pytest.mark.world  # every test here starts processes

SEQ, VOCAB = 16, 128


def _grads_in_world(rank: int, world: int, position_embedding_type: str) -> dict:
    tp = dist.new_group(list(range(world)))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, dims=1)
    results = {}
    for sequence_parallel in (False, True):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            tensor_model_parallel_size=world,
            sequence_parallel=sequence_parallel,
        )
        model = GPTModel(
            config,
            VOCAB,
            SEQ,
            position_embedding_type=position_embedding_type,
            pg_collection=ProcessGroupCollection(tp=tp),
        )
        tracker = ActivationMemoryTracker()
        tracker.exclude_parameters(model.parameters())
        with tracker.track():
            loss = model(tokens, torch.arange(SEQ).expand_as(tokens), labels=labels).mean()
            loss.backward()
        for p in model.parameters():
            p.main_grad = p.grad
        _allreduce_non_tensor_model_parallel_grads([model], tp)
        results[sequence_parallel] = (
            loss.item(),
            {name: p.grad.clone() for name, p in model.named_parameters()},
            tracker.peak_bytes,
        )
    (loss_tp, grads_tp, peak_tp), (loss_sp, grads_sp, peak_sp) = results[False], results[True]
    errors = {n: ((grads_sp[n] - g).abs().max() / g.abs().max()).item() for n, g in grads_tp.items()}
    worst = max(errors, key=errors.get)
    return {
        "loss": abs(loss_sp - loss_tp) / loss_tp,
        "grad": errors[worst],
        "worst": {n: round(e, 4) for n, e in errors.items() if e > 1e-5},
        "peak_ratio": peak_sp / peak_tp,
    }


def test_sequence_parallel_matches_tensor_parallel_loss_and_every_gradient():
    for position_embedding_type in ("learned_absolute", "rope"):
        for result in run_world(_grads_in_world, 2, position_embedding_type):
            assert result["loss"] <= 1e-6
            assert result["grad"] <= 1e-5, result
            # Norms, dropout and the linears' saved inputs hold s / tp tokens: less saved per rank.
            assert result["peak_ratio"] < 0.85, result
