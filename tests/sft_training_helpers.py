"""What the SFT training tests share (tests/training/test_sft_training.py): a tiny Llama-shaped model's
flags, a list of variable-length examples and the SFT rows built from it (the data helper's sample keys:
tokens, labels, loss_mask, position_ids, cu_seqlens -1 padded, cu_seqlens_argmin, max_seqlen), one step's
forward and backward of such rows through the real forward step and schedule, and a tiny SFT corpus."""

from __future__ import annotations

import os

import torch

from megatron_lite.training import gpt_step

SEQ = 32
TOLERANCE = 1e-5

# Llama-shaped (rotary positions, which must restart at each example), small enough for seconds a layout.
MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    f"--ffn-hidden-size 64 --seq-length {SEQ} --max-position-embeddings {SEQ} --vocab-size 128 "
    "--make-vocab-size-divisible-by 64 --position-embedding-type rope --normalization RMSNorm --swiglu "
    "--disable-bias-linear --untie-embeddings-and-output-weights --micro-batch-size 1 --global-batch-size 4 "
    "--lr 1e-3 --train-iters 1 --eval-iters 0 --seed 1234 --hidden-dropout 0 --attention-dropout 0 "
    "--calculate-per-token-loss"
).split()

# (token-id count, prompt length): each example is a segment of count - 1 positions; its loss is on the
# tokens after the prompt. Packed three to a row, the third row exactly full (no pad tail).
EXAMPLES = list(zip([9, 6, 12, 5, 10, 8, 11, 13, 11, 7, 4, 9], [4, 2, 7, 3, 5, 2, 6, 4, 3, 3, 2, 5]))
PACKS = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def make_examples():
    g = torch.Generator().manual_seed(47)
    return [(torch.randint(1, 128, (n,), generator=g).tolist(), prompt) for n, prompt in EXAMPLES]


def sft_row(examples, boundaries: bool) -> dict:
    """One collated SFT sample (batch of 1) of ``examples``; without ``boundaries`` a plain causal row
    (the one-example-alone reference: no cu_seqlens at all)."""
    tokens, labels, mask, positions, cu = [], [], [], [], [0]
    for ids, prompt in examples:
        n = len(ids) - 1
        tokens += ids[:-1]
        labels += ids[1:]
        mask += [0.0] * (prompt - 1) + [1.0] * (n - prompt + 1)  # labels ids[prompt:] are the answer
        positions += range(n)
        cu.append(cu[-1] + n)
    pad = SEQ - len(tokens)
    assert pad >= 0
    tokens += [0] * pad
    labels += [0] * pad
    mask += [0.0] * pad
    positions += range(pad)
    if pad:
        cu.append(SEQ)  # the pad tail is its own (masked) segment
    row = {
        "tokens": torch.tensor([tokens]),
        "labels": torch.tensor([labels]),
        "loss_mask": torch.tensor([mask]),
        "position_ids": torch.tensor([positions]),
    }
    if boundaries:
        padded = torch.full((1, SEQ + 2), -1, dtype=torch.int32)
        padded[0, : len(cu)] = torch.tensor(cu, dtype=torch.int32)
        row["cu_seqlens"] = padded
        row["cu_seqlens_argmin"] = torch.tensor([len(cu)])
        row["max_seqlen"] = torch.tensor([max(b - a for a, b in zip(cu[:-1], cu[1:]))], dtype=torch.int32)
    return row


def per_example_losses(losses: torch.Tensor, row: dict) -> list[torch.Tensor]:
    """Each example's mean loss over its answer tokens, from a row's per-token losses [1, s]."""
    mask = row["loss_mask"][0]
    cu = row["cu_seqlens"][0].tolist() if "cu_seqlens" in row else [0, SEQ]
    cu = [c for c in cu if c >= 0]
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        if mask[a:b].sum() > 0:
            out.append((losses[0, a:b] * mask[a:b]).sum() / mask[a:b].sum())
    return out


def run_step(s, config, rows, sft: bool | None = True):
    """One step's forward and backward of ``rows`` (one per microbatch) through the schedule, with the
    real forward step; returns (per-example losses on the last stage, lm loss, {param: main_grad})."""
    from megatron_lite.core.pipeline_parallel import get_forward_backward_func
    from megatron_lite.training.utils.loss_reduction import accumulate_loss_reports, reduce_loss_reports

    m = config.model
    if sft is not None:  # a pretraining config told what --sft's dataset config says (its property)
        config.dataset.sft = sft
    seen: list[torch.Tensor] = []

    def step(data_iterator, model):
        output, loss_fn = gpt_step.forward_step(s.state, data_iterator, model)

        def recording(output_tensor):
            seen.append(output_tensor.detach().clone())
            return loss_fn(output_tensor)

        return output, recording

    for chunk in s.model:
        chunk.zero_grad_buffer()
    chunks = len(s.model)
    iterators = [iter(rows) for _ in range(chunks)]
    store = get_forward_backward_func(m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size)(
        forward_step_func=step,
        data_iterator=iterators if chunks > 1 else iterators[0],
        model=s.model,
        num_microbatches=len(rows),
        seq_length=SEQ,
        micro_batch_size=1,
        pg_collection=s.pg_collection,
    )
    # Per example where the last stage holds whole rows (under CP each rank has its share of each example:
    # the step's loss and the gradients say it there).
    whole = m.context_parallel_size == 1
    losses = [loss for out, row in zip(seen, rows) for loss in per_example_losses(out, row)] if whole else []
    report = reduce_loss_reports(accumulate_loss_reports({}, store), s.pg_collection.dp_cp) if store else {}
    grads = {
        f"{c}.{n}": p.main_grad.detach().clone()
        for c, chunk in enumerate(s.model)
        for n, p in chunk.named_parameters()
        if p.requires_grad
    }
    return losses, report.get("lm loss"), grads


def compare(packed, alone) -> dict:
    (lp, rp, gp), (la, ra, ga) = packed, alone
    assert len(lp) == len(la) and gp.keys() == ga.keys()
    return {
        "examples": len(lp),
        "loss": max((abs(a - b).item() for a, b in zip(lp, la)), default=0.0),
        "lm loss": None if rp is None else abs(rp - ra).item(),
        "grad": max((a - b).abs().max().item() for a, b in zip(gp.values(), ga.values())),
        "grad scale": max(g.abs().max().item() for g in ga.values()),
    }


ROW_KEYS = ("tokens", "labels", "loss_mask")


def alone_rows(row: dict) -> list[dict]:
    """Each example of a packed row (the answer-bearing segments of its cu_seqlens) as a plain causal
    row of its own, padded to SEQ."""
    cu = [c for c in row["cu_seqlens"][0].tolist() if c >= 0]
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        if row["loss_mask"][0, a:b].sum() == 0:
            continue  # the pad tail
        pad = SEQ - (b - a)
        row_alone = {k: torch.cat([row[k][:, a:b], row[k].new_zeros(1, pad)], 1) for k in ROW_KEYS}
        out.append({**row_alone, "position_ids": torch.arange(SEQ).unsqueeze(0)})
    return out


def write_sft_data(root: str) -> None:
    """A word-level Hugging Face tokenizer and a JSONL of input / output pairs of varied lengths."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["</s>", "<unk>", *(f"w{i}" for i in range(30))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(root, "tokenizer.json"))
    with open(os.path.join(root, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    g = torch.Generator().manual_seed(7)
    with open(os.path.join(root, "train.jsonl"), "w") as f:
        for n_in, n_out in [(3, 2), (5, 4), (2, 6), (4, 3), (6, 2), (3, 5), (2, 2), (4, 4)]:
            pick = torch.randint(2, len(words), (n_in + n_out,), generator=g).tolist()
            record = {
                "input": " ".join(words[i] for i in pick[:n_in]),
                "output": " ".join(words[i] for i in pick[n_in:]),
            }
            f.write(json.dumps(record) + "\n")
