"""--sft on the command line: the section it builds, its flags, the checks before any worker starts
(bad input is one line naming file and line, exit 2) and the datasets the run reads."""

from __future__ import annotations

import pytest
import torch
from sft_helpers import CHAT_TEMPLATE, records, word_tokenizer, write_jsonl

from megatron_lite.data.base import DatasetBuildContext
from megatron_lite.data.sft.config import SFTDatasetConfig
from megatron_lite.data.sft.packed_file import load_packs
from megatron_lite.training.cli.parser import config_from_argv, parse_args
from megatron_lite.training.config.validate.sft import sft_alignment
from megatron_lite.training.errors import ConfigError
from megatron_lite.training.tokenizers import get_tokenizer

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--train-iters", "3"]
MODEL += ["--micro-batch-size", "1", "--global-batch-size", "4", "--seq-length", "32", "--split", "80,20,0"]


@pytest.fixture
def sft_files(tmp_path):
    word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE)
    data = write_jsonl(tmp_path / "d.jsonl", records())
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok")]
    return tmp_path, data, tok


def test_sft_flags_build_the_sft_section(sft_files):
    _, data, tok = sft_files
    cfg = config_from_argv(
        ["--sft", "--data-path", str(data), *tok, *MODEL, "--sft-packing-algorithm", "first_fit_shuffle"]
    )
    ds = cfg.dataset
    assert isinstance(ds, SFTDatasetConfig) and ds.sft and ds.packing
    assert (ds.seq_length, ds.packing_algorithm, ds.pad_seq_to_mult, ds.truncation) == (
        32,
        "first_fit_shuffle",
        1,
        "error",
    )
    cfg = config_from_argv(
        ["--sft", "--data-path", str(data), *tok, *MODEL, "--no-sft-packing", "--micro-batch-size", "2"]
    )
    assert not cfg.dataset.packing


def test_datasets_yield_packed_rows_and_split_the_examples(sft_files):
    _, data, tok = sft_files
    cfg = config_from_argv(["--sft", "--data-path", str(data), *tok, *MODEL])
    train, valid, test = cfg.dataset.build_datasets(
        DatasetBuildContext(12, 4, 0, tokenizer=get_tokenizer(cfg))
    )
    assert test is None and (len(train), len(valid)) == (12, 4)
    batch = torch.utils.data.default_collate([train[0]])
    assert batch["tokens"].shape == (1, 32) and batch["cu_seqlens"].shape == (1, 34)
    learned = sum(train.examples[i][1][1:].sum() for i in range(len(train.examples)))
    assert (
        len(train.examples) == 24
        and sum(train[i]["loss_mask"].sum() for i in range(len(train.rows))) == learned
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sft-truncation", "right"], "--sft-truncation: needs --sft"),
        (["--sft", "--eod-mask-loss"], "--eod-mask-loss: is a pretraining-data flag"),
        (
            ["--sft", "--micro-batch-size", "2"],
            "--micro-batch-size: 2: packed SFT takes one pack per micro batch",
        ),
        (["--sft", "--sft-packing-algorithm", "best_fit"], "--sft-packing-algorithm: 'best_fit'"),
        (["--sft", "--sft-pad-seq-to-mult", "0"], "--sft-pad-seq-to-mult: must be an integer >= 1"),
        (["--sft", "--seq-length", "30", "--sft-pad-seq-to-mult", "4"], "--seq-length: 30 is not a multiple"),
    ],
)
def test_bad_sft_flags_are_refused(sft_files, extra, message):
    _, data, tok = sft_files
    with pytest.raises(ConfigError) as err:
        config_from_argv(["--data-path", str(data), *tok, *MODEL, *extra])
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"messages": [{"role": "user"', "d.jsonl:31: malformed JSON"),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            "d.jsonl:31: a conversation has no assistant turn",
        ),
        (
            {"input": "a b c " * 20, "output": "ok"},
            "d.jsonl:31: the example is 62 tokens (61 positions), longer than the pack",
        ),
    ],
)
def test_bad_input_stops_the_launch_in_one_line(sft_files, capsys, line, message):
    root, _, tok = sft_files
    data = write_jsonl(root / "d.jsonl", [*records(), line])
    save = root / "ckpt"
    with pytest.raises(SystemExit) as stop:
        parse_args(["--sft", "--data-path", str(data), *tok, *MODEL, "--save", str(save)])
    err = capsys.readouterr().err
    assert (
        stop.value.code == 2
        and err.count("\n") == 1
        and message in err
        and err.startswith("pretrain.py: error: --data-path: ")
    )
    assert not save.exists()


def test_the_layout_sets_the_alignment_as_bridge():
    class Model:
        context_parallel_size, tensor_model_parallel_size, sequence_parallel = 2, 4, True

    assert sft_alignment(Model) == 8
    Model.sequence_parallel = False
    assert sft_alignment(Model) == 4


def test_a_pack_file_trains_the_packs_prepare_sft_data_wrote(sft_files, capsys):
    from corpus_helpers import _tool

    root, data, tok = sft_files
    packs = root / "d.safetensors"
    assert (
        _tool("prepare_sft_data").main(
            ["--input", str(data), "--output", str(packs), "--seq-length", "32", *tok]
        )
        == 0
    )
    cfg = config_from_argv(["--sft", "--data-path", str(packs), *tok, *MODEL])
    train, valid, _ = cfg.dataset.build_datasets(DatasetBuildContext(8, 2, 0, tokenizer=get_tokenizer(cfg)))
    examples, file_packs, _ = load_packs(str(packs))
    assert len(train.rows) + len(valid.rows) == len(file_packs)  # split over the file's packs, in order
    for ds, pack in ((train, file_packs[0]), (valid, file_packs[-1])):
        row = ds.rows[0] if ds is train else ds.rows[-1]
        assert [ds.examples[i][0].tolist() for i in row] == [examples[i][0].tolist() for i in pack]
    assert len(train.examples) + len(valid.examples) == len(examples)
    assert train[0]["cu_seqlens"].shape == (34,)
    with pytest.raises(ConfigError, match=r"d\.safetensors: packed with seq_length 32, this run needs 64"):
        config_from_argv(["--sft", "--data-path", str(packs), *tok, *MODEL, "--seq-length", "64"])


def test_each_file_says_in_one_line_what_was_truncated(sft_files, capsys):
    root, _, tok = sft_files
    data = write_jsonl(root / "long.jsonl", [*records(), {"input": "a b c " * 20, "output": "ok"}])
    cfg = config_from_argv(["--sft", "--data-path", str(data), *tok, *MODEL, "--sft-truncation", "right"])
    capsys.readouterr()
    cfg.dataset.build_datasets(DatasetBuildContext(4, 0, 0, tokenizer=get_tokenizer(cfg)))
    lines = [line for line in capsys.readouterr().out.splitlines() if "long.jsonl" in line]
    assert (
        len(lines) == 1
        and "31 examples" in lines[0]
        and "1 longer than 32 tokens truncated on the right" in lines[0]
    )


def test_rows_are_a_function_of_the_sample_index_so_a_run_resumes_exactly(sft_files):
    _, data, tok = sft_files
    cfg = config_from_argv(["--sft", "--data-path", str(data), *tok, *MODEL])
    context = DatasetBuildContext(40, 0, 0, tokenizer=get_tokenizer(cfg))
    first, again = cfg.dataset.build_datasets(context)[0], cfg.dataset.build_datasets(context)[0]
    for i in (37, 3, 25, 0):  # any order, any epoch (the 40 samples run over several)
        assert all(torch.equal(first[i][k], again[i][k]) for k in first[i])
    epochs = [
        sorted(map(tuple, (first.rows[first._row(e * len(first.rows) + j)] for j in range(len(first.rows)))))
        for e in (0, 1)
    ]
    assert epochs[0] == epochs[1] == sorted(map(tuple, first.rows))  # every pack once per epoch


def test_per_split_files_are_each_a_split(sft_files):
    root, data, tok = sft_files
    valid = write_jsonl(root / "v.jsonl", records(6))
    model = [a for a in MODEL if a not in ("--split", "80,20,0")]
    cfg = config_from_argv(
        ["--sft", "--train-data-path", str(data), "--valid-data-path", str(valid), *tok, *model]
    )
    train, valid_ds, test = cfg.dataset.build_datasets(
        DatasetBuildContext(8, 2, 2, tokenizer=get_tokenizer(cfg))
    )
    assert test is None and len(train.examples) == 30 and len(valid_ds.examples) == 6
    with pytest.raises(ConfigError, match="weighted blends are not supported yet"):
        config_from_argv(["--sft", "--data-path", "0.5", str(data), "0.5", str(valid), *tok, *MODEL])
