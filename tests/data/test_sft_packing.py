"""SFT packing: Bridge's first-fit algorithms, packed rows with each example's boundaries and restarted
positions, the offline pack file (no pickle, reproducible) and tools/prepare_sft_data.py."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch
from corpus_helpers import _tool
from sft_helpers import CHAT_TEMPLATE, word_tokenizer, write_jsonl

from megatron_lite.data.sft.build import load_jsonl, rows_for
from megatron_lite.data.sft.config import SFTDatasetConfig
from megatron_lite.data.sft.dataset import GPTSFTPackedDataset, TokenizedExamples
from megatron_lite.data.sft.packed_file import load_packs, save_packs
from megatron_lite.data.sft.packing import build_row, first_fit, first_fit_decreasing, pack_examples
from megatron_lite.training.errors import ConfigError

prepare_sft_data = _tool("prepare_sft_data")


def _naive_first_fit(lengths, size):
    bins, free = [], []
    for n in lengths:
        i = next((i for i, f in enumerate(free) if f >= n), None)
        if i is None:
            bins.append([]), free.append(size)
            i = len(bins) - 1
        bins[i].append(n)
        free[i] -= n
    return bins


def test_first_fit_matches_the_definition_and_decreasing_sorts_first():
    lengths = [random.Random(0).randint(1, 40) for _ in range(300)]
    assert first_fit(lengths, 64) == _naive_first_fit(lengths, 64)
    assert first_fit_decreasing(lengths, 64) == _naive_first_fit(sorted(lengths, reverse=True), 64)
    assert first_fit_decreasing([5, 3, 7], 10, item_lengths=[5, 3, 7]) == [[7, 3], [5]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit([65], 64)


def _examples(lengths, seed=0):
    """Examples of ``lengths`` ids, the second half of each an answer."""
    rng = np.random.default_rng(seed)
    pairs = []
    for n in lengths:
        answer = np.arange(n) >= n // 2
        pairs.append((rng.integers(3, 20, n).astype(np.int32), answer))
    return TokenizedExamples.from_list(pairs)


def test_packed_row_keeps_each_example_as_it_is_alone():
    examples = _examples([5, 9, 4])
    row = build_row([examples[0], examples[1], examples[2]], 20, pad_id=0)
    assert row["cu_seqlens"][: row["cu_seqlens_argmin"]].tolist() == [0, 4, 12, 15, 20]
    assert row["position_ids"].tolist() == [*range(4), *range(8), *range(3), *range(5)]
    assert row["max_seqlen"].item() == 8
    for i, (start, end) in enumerate([(0, 4), (4, 12), (12, 15)]):
        alone = build_row([examples[i]], 20, pad_id=0)
        n = end - start
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(row[key][start:end], alone[key][:n]), key
    assert row["loss_mask"][15:].sum() == 0  # the pad tail learns nothing


def test_alignment_pads_each_segment_and_keeps_the_real_boundaries():
    examples = _examples([5, 9])
    row = build_row([examples[0], examples[1]], 16, pad_id=0, pad_seq_to_mult=4)
    assert row["cu_seqlens"][: row["cu_seqlens_argmin"]].tolist() == [0, 4, 12, 16]
    assert row["cu_seqlens_unpadded"][: row["cu_seqlens_unpadded_argmin"]].tolist() == [0, 4, 12, 16]
    row = build_row([_examples([4])[0], examples[1]], 16, pad_id=0, pad_seq_to_mult=4)
    assert row["cu_seqlens"][:4].tolist() == [0, 4, 12, 16]
    assert row["cu_seqlens_unpadded"][:4].tolist() == [0, 3, 11, 15]
    assert row["loss_mask"][3].item() == 0 and row["position_ids"][:4].tolist() == [0, 1, 2, 3]


def test_packed_dataset_covers_every_example_once_per_epoch():
    examples = _examples([random.Random(1).randint(3, 30) for _ in range(50)])
    packs = pack_examples(examples.segment_lengths.tolist(), 32, "first_fit_decreasing")
    ds = GPTSFTPackedDataset(examples, packs, 32, 0, num_samples=2 * len(packs), seed=7)
    learned = sum(ds[i]["loss_mask"].sum().item() for i in range(len(packs)))
    assert learned == sum(a[1:].sum() for _, a in (examples[i] for i in range(len(examples))))
    assert sorted(i for p in packs for i in p) == list(range(50))
    assert ds.padding_tokens() < len(packs) * 32 * 0.15


def test_pack_file_round_trips_without_pickle(tmp_path):
    examples = _examples([4, 7, 3])
    packs = [[0, 2], [1]]
    path = str(tmp_path / "p.safetensors")
    save_packs(path, examples, packs, {"seq_length": 8})
    loaded, loaded_packs, meta = load_packs(path)
    assert loaded_packs == packs and meta["seq_length"] == "8"
    assert np.array_equal(loaded.ids, examples.ids) and np.array_equal(loaded.offsets, examples.offsets)
    (tmp_path / "bad.safetensors").write_bytes(b"\x80\x04not a file")
    with pytest.raises(ConfigError, match="bad.safetensors: cannot be read as a pack file"):
        load_packs(str(tmp_path / "bad.safetensors"))


def _corpus(tmp_path, n=40):
    rng = random.Random(2)
    words = ["a", "b", "c", "hi", "hello", "there", "ok"]
    records = []
    for i in range(n):
        turns = [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 8)))}]
        turns.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 10)))})
        records.append(
            {"messages": turns} if i % 2 else {"input": turns[0]["content"], "output": turns[1]["content"]}
        )
    return write_jsonl(tmp_path / "d.jsonl", records)


def test_prepare_sft_data_is_reproducible_and_trains_the_same_rows(tmp_path):
    tok_dir = tmp_path / "tok"
    tok = word_tokenizer(tok_dir, CHAT_TEMPLATE)
    data = _corpus(tmp_path)
    argv = [
        "--input",
        str(data),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tok_dir),
    ]
    argv += ["--seq-length", "32"]
    digests = []
    for name in ("one", "two"):
        out = tmp_path / f"{name}.safetensors"
        assert prepare_sft_data.main([*argv, "--output", str(out)]) == 0
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    examples, packs, _ = load_packs(str(tmp_path / "one.safetensors"))
    online, _, _ = load_jsonl(str(data), tok, 32, "error", 1, True)
    config = SFTDatasetConfig(seq_length=32, data_path=[str(data)])
    assert np.array_equal(examples.ids, online.ids) and packs == rows_for(online, config)


def test_prepare_sft_data_refuses_bad_input_and_writes_nothing(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    word_tokenizer(tok_dir)
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "a", "output": "b"}, '{"input": "a",'])
    out = tmp_path / "p.safetensors"
    argv = ["--input", str(data), "--output", str(out), "--tokenizer-type", "HuggingFaceTokenizer"]
    code = prepare_sft_data.main([*argv, "--tokenizer-model", str(tok_dir), "--seq-length", "16"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists() and list(tmp_path.glob("p.safetensors*")) == []
    assert err.count("\n") == 0 and "d.jsonl:2: malformed JSON" in err
