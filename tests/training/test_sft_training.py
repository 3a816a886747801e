"""SFT with packed sequences end to end (issue 47): the packing invariant through the real forward step,
schedules and gradient finalisation, and the pieces it rests on.

The invariant: a few variable-length examples packed into rows (``cu_seqlens`` boundaries, positions
restarting at each example, a masked pad tail) give every example the loss it gets run alone, and the
step the same gradients, within 1e-5, with ``--calculate-per-token-loss``, at pp 4 (its middle stages
must get the boundaries: Megatron-Bridge #2952), interleaved pp 4 x vp 2, tp 2 with sequence
parallelism and full recomputation at pp 2, pp 1 at tp 2 x dp 2, fully fine-tuned and with LoRA, and
dp 4 with the distributed optimizer.
One 4-process world runs every layout (each sets up its own groups), on rows built from a small list of
examples with the SFT sample's keys (sft_training_helpers.py), and once on the rows of ``--sft``'s own
loader at cp 2 x pp 2. A packed job's dry run runs the packed attention and agrees with the prediction.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from dist_helpers import run_world
from sft_training_helpers import (
    EXAMPLES,
    MODEL,
    PACKS,
    SEQ,
    TOLERANCE,
    alone_rows,
    compare,
    make_examples,
    run_step,
    sft_row,
    write_sft_data,
)

from megatron_lite.core.packed_seq_params import PackedSeqParams
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.training import gpt_step
from megatron_lite.training.utils.packed_seq_utils import batches_carry_boundaries, get_packed_seq_params

# --- one process: the batch's boundaries, the middle stage, the per-token loss -------------------------


def _sft_cfg(sft=True):
    return SimpleNamespace(dataset=SimpleNamespace(sft=sft))


def test_packed_seq_params_strip_the_padding_of_cu_seqlens():
    row = sft_row([make_examples()[i] for i in PACKS[0]], boundaries=True)
    params = get_packed_seq_params(row)
    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 8, 13, 24, 32] and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_kv is params.cu_seqlens_q and params.cu_seqlens_q_padded is None
    assert params.max_seqlen_q == params.max_seqlen_kv == 11
    del row["cu_seqlens_argmin"]  # found from the -1 padding instead
    assert get_packed_seq_params(row).cu_seqlens_q.tolist() == [0, 8, 13, 24, 32]
    # Bridge's padded examples: the real ends are cu_seqlens_q, the physical ones the *_padded.
    row["cu_seqlens_unpadded"] = torch.tensor([[0, 7, 12, 22, 30, -1]], dtype=torch.int32)
    params = get_packed_seq_params(row)
    assert params.cu_seqlens_q.tolist() == [0, 7, 12, 22, 30]
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 13, 24, 32]
    with pytest.raises(ValueError, match="--micro-batch-size 1"):
        get_packed_seq_params({"cu_seqlens": torch.zeros(2, SEQ + 2, dtype=torch.int32)})


def _pp(stage, stages):
    return ProcessGroupCollection(pp=SimpleNamespace(rank=lambda: stage, size=lambda: stages))


def test_every_pipeline_stage_gets_the_boundaries_of_a_packed_batch():
    """Bridge #2952: a middle stage (pp 4, stages 1 and 2) must attend within the examples too, so it
    reads its own iterator's batch and keeps only the boundaries; first and last keep their tensors."""
    row = sft_row([make_examples()[i] for i in PACKS[0]], boundaries=True)
    assert batches_carry_boundaries(_sft_cfg()) and not batches_carry_boundaries(_sft_cfg(False))
    for stage in range(4):
        data = iter([row])
        batch = gpt_step.get_batch(data, _sft_cfg(), pg_collection=_pp(stage, 4))
        assert batch[-1].cu_seqlens_q.tolist() == [0, 8, 13, 24, 32], stage
        assert next(data, None) is None  # one batch read per microbatch on every stage
        middle = stage in (1, 2)
        assert (batch[0] is None) == middle and (batch[1] is None) == middle
    # Pretraining data: a middle stage still reads nothing.
    data = iter([row])
    assert gpt_step.get_batch(data, _sft_cfg(False), pg_collection=_pp(1, 4)) == (None,) * 6
    assert next(data) is row


def test_unpacked_rows_of_a_larger_micro_batch_need_no_boundaries():
    rows = [sft_row([e], boundaries=True) for e in make_examples()[:2]]
    batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    *tensors, params = gpt_step.get_batch(iter([batch]), _sft_cfg(), pg_collection=_pp(0, 1))
    assert params is None and tensors[0].shape == (2, SEQ)  # causal attention keeps each from its pad


def test_per_token_loss_reports_sum_and_tokens():
    model = SimpleNamespace(config=SimpleNamespace(calculate_per_token_loss=True))
    losses, mask = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    loss, tokens, report = gpt_step.loss_func(mask, losses, model=model)
    assert loss.item() == 5.0 and tokens.item() == 2 and tokens.dtype == torch.int
    assert report["lm loss"].tolist() == [5.0, 2.0]  # upstream's [sum, tokens]: the step's token mean
    _, _, report = gpt_step.loss_func(mask, losses)
    assert report["lm loss"].item() == 2.5  # without: the microbatch's mean


# --- the invariant in a 4-process world -----------------------------------------------------------------

LAYOUTS = {
    "pp4": ["--pipeline-model-parallel-size", "4"],
    # Interleaved: every rank's two chunks, the middle ranks' included, read their own iterators.
    "pp4-vp2": "--pipeline-model-parallel-size 4 --virtual-pipeline-model-parallel-size 2 --num-layers 8".split(),
    "tp2-sp-pp2-recompute": [
        *"--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2".split(),
        *"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split(),
    ],
    "tp2-dp2": ["--tensor-model-parallel-size", "2"],
    # The token count divides the reduce-scattered shards alike.
    "dp4-distributed-optimizer": ["--use-distributed-optimizer"],
}
# LoRA at pp 1 x tp 2 x dp 2, on the base the SP layout saves (torch_dist: read back at another layout).
TP2_DP2 = LAYOUTS["tp2-dp2"]
CP2_PP2 = "--context-parallel-size 2 --pipeline-model-parallel-size 2".split()
LORA = "--peft lora --lora-dim 4 --lora-alpha 8".split()


def _layout(argv, packed_rows, alone_rows, control: bool = False, save=None):
    """Set up ``argv``'s run, compare packed with one by one; ``control``: also run the packed rows as a
    run that does not say it is SFT (its middle stages read nothing: Bridge #2952's failure)."""
    import torch.distributed as dist

    from megatron_lite.core import parallel_state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.setup import setup
    from megatron_lite.training.state import GlobalState

    config = parse_args([*argv, "--nproc-per-node", str(dist.get_world_size())])
    state = GlobalState(config)
    try:
        s = setup(state)
        alone = run_step(s, config, alone_rows)
        out = compare(run_step(s, config, packed_rows), alone)
        if control:
            out["control"] = compare(run_step(s, config, packed_rows, sft=False), alone)
        if save is not None:
            config.checkpoint.ckpt_format, config.checkpoint.save = "torch_dist", save
            state.train_state.step = 1
            checkpointing.save_checkpoint(state, s.model, s.optimizer, s.scheduler, s.pg_collection)
        return out
    finally:
        dist.barrier()
        parallel_state.destroy_model_parallel()


def _sft_run(argv, packs: int):
    """``argv`` with --sft, at its layout: the first ``packs`` rows of its own data loader, packed, against
    their examples one by one."""
    import torch.distributed as dist

    from megatron_lite.core import parallel_state
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.setup import setup
    from megatron_lite.training.state import GlobalState

    config = parse_args([*argv, "--nproc-per-node", str(dist.get_world_size())])
    state = GlobalState(config)
    try:
        s = setup(state)
        packed = [next(s.train_data_iterator) for _ in range(packs)]
        alone = [r for row in packed for r in alone_rows(row)]
        out = compare(run_step(s, config, packed, sft=None), run_step(s, config, alone, sft=None))
        out["packed examples"] = len(alone)
        return out
    finally:
        dist.barrier()
        parallel_state.destroy_model_parallel()


def _world(rank, world, root):
    examples = make_examples()
    packed = [sft_row([examples[i] for i in pack], boundaries=True) for pack in PACKS]
    alone = [sft_row([e], boundaries=False) for e in examples]
    out = {}
    for name, flags in LAYOUTS.items():
        base = os.path.join(root, "base") if name == "tp2-sp-pp2-recompute" else None
        out[name] = _layout([*MODEL, *flags], packed, alone, control=name == "pp4", save=base)
    lora = [*MODEL, *TP2_DP2, *LORA, "--pretrained-checkpoint", os.path.join(root, "base")]
    out["tp2-dp2-lora"] = _layout(lora, packed, alone)
    # Through --sft's own dataset and loader (the data helper's), at cp 2 x pp 2: each example padded to a
    # multiple of 2 cp (Bridge's rule) and split over the CP ranks.
    sft = [f for f in MODEL if f not in ("--vocab-size", "128")]
    sft += [*"--sft --split 100,0,0 --tokenizer-type HuggingFaceTokenizer".split(), "--tokenizer-model", root]
    sft += [
        "--data-path",
        os.path.join(root, "train.jsonl"),
        "--num-workers",
        "0",
        *CP2_PP2,
    ]  # no loader processes
    out["sft-cp2-pp2"] = _sft_run(sft, packs=2)
    return out


@pytest.mark.world
def test_packed_rows_match_each_example_alone_at_every_layout(tmp_path):
    write_sft_data(str(tmp_path))
    results = run_world(_world, 4, str(tmp_path))
    for rank, result in enumerate(results):
        for name, r in result.items():
            where = f"{name}, rank {rank}: {r}"
            assert r["grad"] <= TOLERANCE and r["grad scale"] > 100 * TOLERANCE, where
            assert r["lm loss"] is None or r["lm loss"] <= TOLERANCE, where  # the step's, on the last stage
            if r["examples"]:  # the last stage, whole rows: every example's own loss
                assert r["examples"] == r.get("packed examples", len(EXAMPLES)), where
                assert r["loss"] <= TOLERANCE, where
    # The pp 4 control catches Bridge #2952: without the boundaries on its middle stages the packed
    # examples attend to each other there, and the last stage's losses move.
    control = results[3]["pp4"]["control"]
    assert control["examples"] == len(EXAMPLES) and control["loss"] > 1e-3, control
    assert all(r["pp4"]["control"]["grad"] > 1e-4 for r in results)  # and every stage's gradients
    assert results[3]["sft-cp2-pp2"]["packed examples"] > 2  # --sft's loader packed several a row


# --- the dry run and the prediction of a packed job ------------------------------------------------------


@pytest.mark.world
def test_the_dry_run_of_a_packed_job_runs_packed_attention_and_the_prediction_knows_it(tmp_path):
    """--sft at pp 2: each stage's real code on the dry run's fake pack allocates what the prediction says; the prediction of the same job unpacked, short of what
    packed attention keeps (linear_proj's own input copy), is 3% short on the first stage."""
    from megatron_lite.run_modes.dry_run import dry_run_stages
    from megatron_lite.training.arguments import config_from_argv
    from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

    root = str(tmp_path)
    write_sft_data(root)
    shape = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --position-embedding-type rope --seq-length 64"
    job = [*shape.split(), *"--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8".split()]
    job += [*"--pipeline-model-parallel-size 2 --nproc-per-node 2 --calculate-per-token-loss".split()]
    sft = [*"--sft --split 100,0,0 --tokenizer-type HuggingFaceTokenizer".split(), "--tokenizer-model", root]
    packed = config_from_argv([*job, *sft, "--data-path", os.path.join(root, "train.jsonl")])
    plain = config_from_argv([*job, "--vocab-size", "32"])  # the same padded vocabulary, no boundaries
    dry = dry_run_stages(packed)
    predicted, unpacked = predict_memory_per_stage(packed), predict_memory_per_stage(plain)
    # The first stage's prediction is exact but for 0.03% unpacked too; the last one's 1% below the
    # measured is the unpacked job's own (its fake batches and received activations).
    for d, p, tolerance in zip(dry, predicted, (0.005, 0.02)):
        assert abs(p.peak_bytes - d.max_allocated_bytes) <= tolerance * d.max_allocated_bytes, (
            d,
            p.peak_bytes,
        )
    assert dry[0].max_allocated_bytes - unpacked[0].peak_bytes > 0.02 * dry[0].max_allocated_bytes
