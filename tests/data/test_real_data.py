"""Real data through pretrain.py: a stdlib-docstring corpus preprocessed by tools/preprocess_data.py
trains at pp = 2 x dp = 2 below its unigram entropy and resumes bitwise; the data and tokenizer flags
map onto the config, and each bad input is one line before anything starts."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from corpus_helpers import make_corpus
from dist_helpers import REPO, loss_lines, parse_losses, run_pretrain, run_script

from megatron_lite.core.datasets.indexed_dataset import IndexedDataset
from megatron_lite.data.loaders import build_train_valid_datasets
from megatron_lite.training.arguments import parse_args
from megatron_lite.training.tokenizers import get_tokenizer

VOCAB = 320  # the BPE's size; the model pads it to 384


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``(root, prefix, vocab.json, merges.txt)``: about 300 kB of docstrings, preprocessed once."""
    root = tmp_path_factory.mktemp("real_data")
    docs, vocab, merges = make_corpus(root, max_bytes=300_000, vocab_size=VOCAB)
    job = run_script(
        REPO / "tools" / "preprocess_data.py",
        [
            "--input", str(docs), "--json-keys", "text", "--output-prefix", str(root / "docs"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges), "--append-eod",
            "--workers", "1",
        ],
        root,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    return root, str(root / "docs_text_document"), str(vocab), str(merges)


def _data(corpus, *extra, split="98,2,0"):
    _root, prefix, vocab, merges = corpus
    return [
        "--data-path", prefix, "--split", split, "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab, "--merge-file", merges, *extra,
    ]  # fmt: skip


MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 8 --global-batch-size 32 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 "
    "--train-iters 60 --eval-interval 6 --eval-iters 1 --log-interval 1 "
    "--pipeline-model-parallel-size 2 --nproc-per-node 4"
).split()


def _ok(result):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    return result


def _validation_lines(stdout: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if "validation loss at iteration" in line]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """60 iterations straight, saving every 6; resumed from iteration 6 (--ckpt-step) to 12. pp = 2,
    dp = 2."""
    run = tmp_path_factory.mktemp("runs")
    args = [*MODEL, *_data(corpus, "--data-cache-path", str(run / "cache"))]
    straight = _ok(run_pretrain([*args, "--save", "ckpt", "--save-interval", "6"], run))
    resumed = _ok(run_pretrain([*args, "--load", "ckpt", "--ckpt-step", "6", "--exit-interval", "12"], run))
    return run, straight, resumed


def unigram_entropy(prefix: str) -> float:
    """Entropy (nats) of the corpus's token frequencies, counted in the .bin."""
    tokens = np.fromfile(prefix + ".bin", dtype=IndexedDataset(prefix).index.dtype)
    p = np.bincount(tokens) / tokens.size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@pytest.mark.world
def test_training_on_real_text_falls_below_the_unigram_entropy(corpus, trained):
    _run, straight, _ = trained
    losses = parse_losses(straight.stdout)
    entropy = unigram_entropy(corpus[1])
    assert sorted(losses) == list(range(1, 61))
    assert losses[1] > entropy + 1.0  # starts near ln(384): the model knows nothing yet
    final = np.mean([losses[i] for i in range(56, 61)])
    # Below what knowing only the token frequencies gives: it has learnt context (here ~3.9 vs 4.5).
    assert final < entropy - 0.3, (final, entropy)
    assert " > padded vocab (size: 320) with 64 dummy tokens (new size: 384)" in straight.stdout


@pytest.mark.world
def test_resume_on_real_data_is_bitwise_identical(trained):
    _run, straight, resumed = trained
    expected, got = loss_lines(straight.stdout), loss_lines(resumed.stdout)
    assert sorted(got) == list(range(7, 13))
    assert {i: expected[i] for i in range(7, 13)} == got
    # The validation stream resumes at its own consumed-sample count too.
    assert _validation_lines(straight.stdout)[1] == _validation_lines(resumed.stdout)[0]


@pytest.mark.world
def test_indices_are_cached_under_data_cache_path_only(corpus, trained):
    run, _, _ = trained
    cached = sorted(p.name.split("-", 1)[1] for p in (run / "cache").iterdir())
    assert "GPTDataset-train-shuffle_index.npy" in cached and "GPTDataset-valid-sample_index.npy" in cached
    assert not (corpus[0] / "docs_text_document").exists()  # upstream's default place, unused here


@pytest.mark.world
def test_an_unreadable_index_cache_is_one_line_from_the_workers(corpus, trained, tmp_path):
    run, _, _ = trained
    cache = tmp_path / "cache"
    shutil.copytree(run / "cache", cache)
    bad = next(cache.glob("*-GPTDataset-train-shuffle_index.npy"))
    bad.write_bytes(b"not an array")
    result = run_pretrain([*MODEL, *_data(corpus, "--data-cache-path", str(cache))], tmp_path, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{bad}: not a readable index cache" in lines[0], result.stderr


@pytest.mark.world
def test_data_flags_map_onto_the_dataset_and_tokenizer_sections(corpus, tmp_path, capsys):
    _root, prefix, vocab, merges = corpus
    cfg = parse_args(
        [
            *_data(corpus, "--data-cache-path", str(tmp_path), "--eod-mask-loss", "--reset-position-ids"),
            "--data-path", "0.3", prefix, "0.7", prefix, "--vocab-size", "999", "--num-workers", "0",
        ]
    )  # fmt: skip
    ds, tok = cfg.dataset, cfg.tokenizer
    assert ds.blend == ([prefix, prefix], [0.3, 0.7]) and not ds.mock
    assert ds.split_matrix == [(0.0, 0.98), (0.98, 1.0), None] and ds.path_to_cache == str(tmp_path)
    assert ds.eod_mask_loss and ds.reset_position_ids and not ds.reset_attention_mask
    assert ds.num_workers == 0 and ds.random_seed == cfg.rng.seed and ds.sequence_length == 64
    assert (tok.tokenizer_type, tok.vocab_file, tok.merge_file) == ("GPT2BPETokenizer", vocab, merges)
    assert cfg.model.vocab_size == VOCAB and cfg.model.padded_vocab_size == 384  # the tokenizer's
    out = capsys.readouterr().out
    assert "pretrain.py: note: --vocab-size 999 is ignored" in out
    per_split = parse_args(
        ["--train-data-path", prefix, "--valid-data-path", "1", prefix, "--tokenizer-type", "NullTokenizer"]
    )
    assert per_split.dataset.blend_per_split == [([prefix], None), ([prefix], [1.0]), None]
    assert per_split.dataset.num_workers == 2  # upstream's default for real data; mock reads in-process
    assert per_split.model.vocab_size == 1024  # NullTokenizer: model.vocab_size - 1 ids plus its EOD
    legacy = parse_args(["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "400"])
    assert legacy.dataset.split == "969, 30, 1" and legacy.model.vocab_size == 401
    assert 'Using legacy default value of "969, 30, 1"' in capsys.readouterr().out
    assert parse_args([]).dataset.mock and parse_args([]).dataset.num_workers == 0


def _bad_inputs(root, prefix, vocab, merges):
    only_bin = root / "only_bin"
    only_bin.mkdir(exist_ok=True)
    (only_bin / "d.bin").write_bytes(b"")
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    damaged = root / "damaged"  # malformed files: each one line naming the file, none a traceback
    damaged.mkdir(exist_ok=True)
    (damaged / "vocab.json").write_text('{"a": 1,,')
    (damaged / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    for name, keep in (("short_idx", (100, None)), ("short_bin", (None, 1000))):
        for ext, cut in zip((".idx", ".bin"), keep):
            data = open(prefix + ext, "rb").read()
            (damaged / f"{name}{ext}").write_bytes(data[:cut] if cut else data)
    return [
        (["--data-path", str(damaged / "short_idx"), *gpt2], "--data-path", "short_idx.idx: 100 bytes"),
        (
            ["--data-path", str(damaged / "short_bin"), *gpt2],
            "--data-path",
            "short_bin.bin: 1000 bytes",
            "truncated",
        ),
        (
            [
                "--data-path",
                prefix,
                *gpt2[:2],
                "--vocab-file",
                str(damaged / "vocab.json"),
                "--merge-file",
                merges,
            ],
            "--vocab-file",
            "cannot be built from its files",
        ),
        (
            [
                "--data-path",
                prefix,
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(damaged / "tokenizer.json"),
            ],
            "--tokenizer-model",
            "EOF while parsing",
        ),
        (["--data-path", str(root / "missing"), *gpt2], "--data-path", "not found"),
        (["--data-path", str(only_bin / "d"), *gpt2], "--data-path", "d.idx not found"),
        (
            ["--data-path", prefix, *gpt2[:2], "--vocab-file", vocab + ".x", "--merge-file", merges],
            "--vocab-file",
        ),
        (["--data-path", prefix, *gpt2[:4], "--merge-file", merges + ".x"], "--merge-file", "does not exist"),
        (["--data-path", prefix, *gpt2, "--split", "90,x"], "--split", "non-negative"),
        (["--data-path", prefix, *gpt2, "--split", "0,0,0"], "--split", "all zero"),
        (["--data-path", prefix, *gpt2, "--split", "8,1,1,1"], "--split"),
        (["--data-path", prefix, *gpt2, "--split", "100000,1,0"], "--split", "valid split"),
        (["--data-path", "0.3", prefix, "0.7", *gpt2], "--data-path", "'0.3' looks like a weight"),
        (["--data-path", "0.3", prefix, "x", prefix, *gpt2], "--data-path", "'x'"),
        (["--data-path", "0", prefix, "1", prefix, *gpt2], "--data-path", "positive"),
        (["--data-path", prefix], "--tokenizer-type", "required"),
        (["--data-path", prefix, "--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-type"),
        (["--data-path", prefix, *gpt2, "--reset-attention-mask"], "--reset-attention-mask"),
        (["--data-path", prefix, "--train-data-path", prefix, *gpt2], "--train-data-path"),
        (["--valid-data-path", prefix, *gpt2], "--train-data-path", "required"),
        (["--train-data-path", prefix, "--split", "1,1,1", *gpt2], "--split"),
        (["--mock-data", "--data-path", prefix, *gpt2], "--mock-data"),
        (["--eod-mask-loss"], "--eod-mask-loss", "needs real data"),
        (["--split", "1,1,1"], "--split", "needs real data"),
    ]


@pytest.mark.world
def test_each_bad_data_input_is_one_line_naming_the_flag(corpus, capsys):
    root, prefix, vocab, merges = corpus
    for argv, flag, *words in _bad_inputs(root, prefix, vocab, merges):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2, argv
        assert err.count("\n") == 1 and err.startswith(f"pretrain.py: error: {flag}: "), (argv, err)
        assert all(w in err for w in words) and "Traceback" not in err, (argv, err)


@pytest.mark.world
def test_bad_data_input_starts_no_worker_and_writes_nothing(corpus, tmp_path):
    root, prefix, vocab, merges = corpus
    before = sorted(p.name for p in root.iterdir())
    result = run_pretrain([*_data(corpus, split="100000,1,0"), "--save", "ckpt"], tmp_path, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "--split" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == [] and sorted(p.name for p in root.iterdir()) == before


@pytest.mark.world
def test_eod_mask_loss_and_reset_position_ids_shape_the_samples(corpus, tmp_path):
    eod = 0  # <|endoftext|>, the BPE's first token
    plain = parse_args(_data(corpus, "--data-cache-path", str(tmp_path)))
    masked = parse_args(
        _data(corpus, "--data-cache-path", str(tmp_path), "--eod-mask-loss", "--reset-position-ids")
    )
    (plain_train, _), (masked_train, _) = (
        build_train_valid_datasets(plain, tokenizer=get_tokenizer(plain)),
        build_train_valid_datasets(masked, tokenizer=get_tokenizer(masked)),
    )
    # A sample with a document boundary inside it (not at its last token).
    i = next(i for i in range(len(plain_train)) if (plain_train[i]["tokens"][:-1] == eod).any())
    before, after = plain_train[i], masked_train[i]
    tokens = before["tokens"].tolist()
    assert after["tokens"].tolist() == tokens  # the flags shape masks and positions, not the samples
    assert before["loss_mask"].eq(1).all() and before["position_ids"].tolist() == list(range(64))
    assert after["loss_mask"].tolist() == [0.0 if t == eod else 1.0 for t in tokens]
    expected, position = [], 0
    for t in tokens:
        expected.append(position)
        position = 0 if t == eod else position + 1
    assert after["position_ids"].tolist() == expected
