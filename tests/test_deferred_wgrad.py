"""--defer-embedding-wgrad-compute in real gloo worlds: the last stage's output-layer weight gradients
computed at the pipeline flush give the same bits as computed in each backward (1F1B, interleaved,
bf16, tensor + sequence parallel), the buffers hold what the memory prediction says, and
--wgrad-deferral-limit defers only the first microbatches."""

from __future__ import annotations

import numpy as np
import torch
from dist_helpers import run_world

from megatron_lite.core import parallel_state as ps
from megatron_lite.core.datasets.gpt_dataset import MockGPTDataset
from megatron_lite.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.core.pipeline_parallel import get_forward_backward_func
from megatron_lite.core.tensor_parallel import linear_wgrad
from megatron_lite.data.samplers import build_pretraining_data_loader
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.training.arguments import parse_args
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.forward_step_func_types import prepare_forward_step_func
from megatron_lite.training.gpt_step import forward_step
from megatron_lite.training.state import GlobalState
from megatron_lite.training.utils.theoretical_memory import predict_memory_per_stage

SEQ, MBS, MICROBATCHES, LAYERS, HIDDEN, VOCAB = 32, 2, 4, 4, 64, 256


_DRAIN = linear_wgrad.drain_wgrad


def _observe_drains(seen: list) -> None:
    """Record, at each drain, how many microbatches it holds and the bytes of their storages."""
    drain = _DRAIN

    def observed(inputs, grads, weight, tp_group, sequence_parallel):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*inputs, *grads]}
        one_input = inputs[0].untyped_storage().nbytes() if inputs else 0
        seen.append((len(inputs), len(grads), sum(storages.values()), one_input))
        untouched = weight.main_grad.clone()
        drain(inputs, grads, weight, tp_group, sequence_parallel)
        seen.append(not torch.equal(untouched, weight.main_grad))  # the drain added something

    linear_wgrad.drain_wgrad = observed


def _step(tp: int, vp: int, defer: bool, limit: int = 0, bf16: bool = False, sp: bool = False) -> dict:
    """One training step's gradients on this rank (before the optimizer), and the drains seen."""
    pp = torch.distributed.get_world_size() // tp
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
    )
    cfg = GPTModelProvider(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        vocab_size=VOCAB,
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        sequence_parallel=sp,
        bf16=bf16,
        defer_embedding_wgrad_compute=defer,
        wgrad_deferral_limit=limit,
    )
    chunks = [
        DistributedDataParallel(
            cfg, cfg.provide(vp_stage=c if vp > 1 else None), dp_group=ps.get_data_parallel_group()
        )
        for c in range(vp)
    ]
    cfg.finalize_model_grads_func = finalize_model_grads
    data = MockGPTDataset(vocab_size=VOCAB, sequence_length=SEQ, seed=3, num_samples=100)
    loader = iter(build_pretraining_data_loader(data, 0, MBS, 0, 1))
    batches = [next(loader) for _ in range(MICROBATCHES)]
    seen: list = []
    _observe_drains(seen)
    step = prepare_forward_step_func(forward_step, GlobalState(ConfigContainer()))
    losses = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    # As numpy arrays: pickled by value through the result queue (a tensor would travel as a shared fd).
    grads = {
        f"{c}.{n}": p.main_grad.numpy().copy() for c, m in enumerate(chunks) for n, p in m.named_parameters()
    }
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    holder = chunks[-1].module
    left = (
        (len(holder.embedding_activation_buffer), len(holder.grad_output_buffer)) if defer and last else None
    )
    ps.destroy_model_parallel()
    return {
        "grads": grads,
        "losses": [x["lm loss"].flatten().tolist() for x in losses],
        "seen": seen,
        "left": left,
    }


def _variants(rank, world, variants):
    return [_step(**v) for v in variants]


def _assert_same_bits(a: dict, b: dict) -> None:
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert np.array_equal(a["grads"][name], b["grads"][name]), name
    assert a["losses"] == b["losses"]


def _predicted_deferred_bytes(extra: list[str]) -> int:
    argv = (
        f"--num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads 4 --vocab-size {VOCAB} "
        f"--seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size {MBS} "
        f"--global-batch-size {MBS * MICROBATCHES} --pipeline-model-parallel-size 2 "
        "--defer-embedding-wgrad-compute"
    ).split()
    return predict_memory_per_stage(parse_args([*argv, *extra]))[-1].deferred_wgrad_bytes


def test_deferred_output_layer_wgrad_gives_the_same_bits_at_pp2():
    variants = [
        dict(tp=1, vp=1, defer=False),
        dict(tp=1, vp=1, defer=True),
        dict(tp=1, vp=1, defer=True, limit=2),
        dict(tp=1, vp=2, defer=False),
        dict(tp=1, vp=2, defer=True),
        dict(tp=1, vp=1, defer=False, bf16=True),
        dict(tp=1, vp=1, defer=True, bf16=True),
    ]
    first, last = run_world(_variants, 2, variants)
    plain, deferred, limited, interleaved, interleaved_deferred, bf16, bf16_deferred = last
    _assert_same_bits(plain, deferred)
    _assert_same_bits(interleaved, interleaved_deferred)
    _assert_same_bits(bf16, bf16_deferred)
    for i in (0, 1, 3, 4, 5, 6):
        _assert_same_bits(
            dict(first[i], losses=[]), dict(first[0 if i < 3 else 3 if i < 5 else 5], losses=[])
        )
        assert first[i]["seen"] == []  # the first stage defers nothing
    # Every microbatch deferred, drained into main_grad, buffers left empty; none without the flag.
    assert plain["seen"] == [] and plain["left"] is None
    (held, grads, storage_bytes, one_input), added = deferred["seen"]
    assert (held, grads, added, deferred["left"]) == (MICROBATCHES, MICROBATCHES, True, (0, 0))
    # The buffers' bytes, measured from their storages, against the prediction (which leaves out the
    # last microbatch's input: the saved-tensor peak already counts it).
    assert storage_bytes == MICROBATCHES * (MBS * SEQ * HIDDEN * 4 + MBS * SEQ * VOCAB * 4)
    assert _predicted_deferred_bytes([]) == storage_bytes - one_input
    # --wgrad-deferral-limit 2: two deferred, the rest computed in their backward (another order of
    # the same sums: close, not the same bits).
    (held, grads, storage_bytes, one_input), _ = limited["seen"]
    assert (held, grads) == (2, 2)
    assert _predicted_deferred_bytes(["--wgrad-deferral-limit", "2"]) == storage_bytes - one_input
    name = next(n for n in plain["grads"] if "output_layer" in n)
    assert np.allclose(limited["grads"][name], plain["grads"][name], rtol=1e-5, atol=1e-7)
    assert np.abs(plain["grads"][name]).sum() > 0
    # Interleaved: the last rank's last chunk holds the buffers.
    assert interleaved_deferred["seen"][0][:2] == (MICROBATCHES, MICROBATCHES)
    assert bf16_deferred["seen"][0][2] == MICROBATCHES * (MBS * SEQ * HIDDEN * 2 + MBS * SEQ * VOCAB * 2)


def test_deferred_wgrad_under_tensor_and_sequence_parallelism():
    variants = [dict(tp=2, vp=1, defer=False, sp=True), dict(tp=2, vp=1, defer=True, sp=True)]
    results = run_world(_variants, 4, variants)
    for rank, (plain, deferred) in enumerate(results):
        _assert_same_bits(plain, deferred)
        if rank >= 2:  # the last stage's two TP ranks: each keeps its sequence shard of the input
            (held, _, storage_bytes, one_input), added = deferred["seen"]
            assert held == MICROBATCHES and added and one_input == MBS * SEQ // 2 * HIDDEN * 4
            assert storage_bytes == MICROBATCHES * (one_input + MBS * SEQ * VOCAB // 2 * 4)
