"""tools/preprocess_data.py: upstream's flags and output names; megatron-core reads its files with
the same tokens and document boundaries; bad input is one line naming the line, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from corpus_helpers import _tool, make_corpus
from dist_helpers import REPO
from megatron.core.datasets.indexed_dataset import IndexedDataset as UpstreamIndexedDataset

from megatron_lite.training.tokenizers import TokenizerConfig, build_tokenizer

preprocess_data = _tool("preprocess_data")
# With one worker the tool encodes in this process and sets TOKENIZERS_PARALLELISM here, as in a worker.
pytestmark = pytest.mark.usefixtures("restored_environment")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs, vocab, merges = make_corpus(root, max_bytes=150_000, vocab_size=800)
    # A second key per line, and one empty document, as real corpora have.
    lines = [json.loads(line) for line in docs.open()]
    lines[3]["text"] = ""
    with (root / "two_keys.jsonl").open("w") as f:
        for i, record in enumerate(lines):
            f.write(json.dumps({"text": record["text"], "title": f"Document number {i}"}) + "\n")
    return root, vocab, merges


def _args(root, vocab, merges, *extra, inp="two_keys.jsonl", prefix="out/data"):
    return [
        "--input", str(root / inp), "--output-prefix", str(root / prefix),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges),
        *extra,
    ]  # fmt: skip


@pytest.mark.world
def test_megatron_core_reads_the_output_with_identical_tokens_and_documents(corpus):
    root, vocab, merges = corpus
    args = _args(root, vocab, merges, "--json-keys", "text", "title", "--append-eod", "--workers", "2")
    job = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), *args], capture_output=True, text=True
    )
    assert job.returncode == 0, job.stderr
    assert "docs/s" in job.stderr and "tokens/s" in job.stderr and "MB/s" in job.stderr
    tokenizer = build_tokenizer(
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    )
    records = [json.loads(line) for line in (root / "two_keys.jsonl").open()]
    for key in ("text", "title"):
        theirs = UpstreamIndexedDataset(str(root / f"out/data_{key}_document"))
        assert theirs.index.dtype == np.uint16  # upstream's optimal dtype for this vocabulary
        expected = [tokenizer.tokenize(r[key]) + [tokenizer.eod] if r[key] else [] for r in records]
        nonempty = [e for e in expected if e]
        assert [theirs[i].tolist() for i in range(len(theirs))] == nonempty
        # One document per line; the empty one holds no sequence, as upstream writes it.
        ends = np.cumsum([1 if e else 0 for e in expected]).tolist()
        assert theirs.document_indices.tolist() == [0, *ends]


@pytest.mark.world
def test_one_worker_and_two_write_identical_files(corpus):
    root, vocab, merges = corpus
    for workers in ("1", "2"):
        assert (
            preprocess_data.main(_args(root, vocab, merges, "--workers", workers, prefix=f"w{workers}/d"))
            == 0
        )
    for ext in (".bin", ".idx"):
        one = (root / f"w1/d_text_document{ext}").read_bytes()
        assert one == (root / f"w2/d_text_document{ext}").read_bytes()


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "3: not valid JSON"),
        ('{"body": "x"}', "3: missing key 'text'"),
        ("[1, 2]", "3: expected a JSON object"),
    ],
)
def test_bad_line_is_one_error_naming_it_and_leaves_no_output(corpus, tmp_path, capsys, line, message):
    root, vocab, merges = corpus
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n' + line + '\n{"text": "four"}\n')
    code = preprocess_data.main(
        _args(tmp_path, vocab, merges, "--workers", "1", inp="bad.jsonl", prefix="o/x")
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("preprocess_data.py: error: ") and f"bad.jsonl:{message}" in err[-1]
    assert not [p.name for p in (tmp_path / "o").iterdir()]


def test_missing_tokenizer_file_is_refused_before_any_work(corpus, tmp_path, capsys):
    root, _vocab, merges = corpus
    code = preprocess_data.main(
        _args(root, tmp_path / "no_vocab.json", merges, "--workers", "2", prefix=str(tmp_path / "p"))
    )
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"preprocess_data.py: error: --vocab-file: {tmp_path / 'no_vocab.json'} does not exist (GPT-2 vocab.json)"
    )
    assert not list(tmp_path.iterdir())


def test_null_tokenizer_round_trips_ids(tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n{"text": "7 7"}\n')
    args = [
        "--input",
        str(tmp_path / "ids.jsonl"),
        "--output-prefix",
        str(tmp_path / "n"),
        "--tokenizer-type",
    ]
    assert (
        preprocess_data.main([*args, "NullTokenizer", "--vocab-size", "10", "--append-eod", "--workers", "1"])
        == 0
    )
    data = UpstreamIndexedDataset(str(tmp_path / "n_text_document"))
    assert [data[i].tolist() for i in range(len(data))] == [[1, 2, 3, 10], [7, 7, 10]]
