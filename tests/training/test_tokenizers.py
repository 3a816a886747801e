"""build_tokenizer: NullTokenizer, GPT2BPETokenizer and HuggingFaceTokenizer on local files only,
checked against transformers' pure-Python GPT2Tokenizer and megatron-core's NullTokenizer."""

from __future__ import annotations

import json

import pytest
from corpus_helpers import make_corpus

from megatron_lite.training.errors import ConfigError
from megatron_lite.training.tokenizers import TokenizerConfig, build_tokenizer

TEXTS = [
    "Return the number of items in a container.",
    "  Leading spaces, trailing\ttabs\t and\nnewlines\n\n",
    "Unicode: naïve café — 東京 🐍 and numbers 12345 67.89",
    "def f(x):\n    return x ** 2  # don't panic, it's fine",
]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    _docs, vocab, merges = make_corpus(tmp_path_factory.mktemp("bpe"), max_bytes=200_000, vocab_size=600)
    return vocab, merges


def _gpt2(vocab, merges):
    return build_tokenizer(
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    )


def test_gpt2_bpe_matches_transformers_pure_python_gpt2_tokenizer(bpe_files):
    from transformers import GPT2Tokenizer

    vocab, merges = bpe_files
    ours = build_tokenizer(
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    )
    oracle = GPT2Tokenizer(vocab_file=str(vocab), merges_file=str(merges))
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == oracle.encode(text), text
        assert ours.detokenize(ids) == text
    assert ours.tokenize_batch(TEXTS) == [oracle.encode(t) for t in TEXTS]
    assert ours.vocab_size == len(oracle) == len(json.loads(vocab.read_text()))
    assert ours.eod == oracle.convert_tokens_to_ids("<|endoftext|>")


def test_gpt2_fast_path_equals_the_tokenizers_bpe_on_real_text(bpe_files):
    ours = _gpt2(*bpe_files)
    assert ours._fast is not None  # tiktoken encodes; tokenizers' BPE is the reference here
    texts = [json.loads(line)["text"] for line in (bpe_files[0].parent / "docs.jsonl").open()]
    reference = [e.ids for e in ours._tokenizer.encode_batch(texts, add_special_tokens=False)]
    assert ours.tokenize_batch(texts) == reference


def test_gpt2_files_tiktoken_cannot_reproduce_fall_back_to_tokenizers(tmp_path, bpe_files):
    from transformers import GPT2Tokenizer

    vocab = json.loads(bpe_files[0].read_text())
    merged = sorted((i for t, i in vocab.items() if len(t) > 1 and t != "<|endoftext|>"))
    swap = {merged[0]: merged[-1], merged[-1]: merged[0]}  # two merges' ids out of merge order
    (tmp_path / "vocab.json").write_text(json.dumps({t: swap.get(i, i) for t, i in vocab.items()}))
    ours = _gpt2(tmp_path / "vocab.json", bpe_files[1])
    assert ours._fast is None
    oracle = GPT2Tokenizer(vocab_file=str(tmp_path / "vocab.json"), merges_file=str(bpe_files[1]))
    assert [ours.tokenize(t) for t in TEXTS] == [oracle.encode(t) for t in TEXTS]


def test_huggingface_tokenizer_from_a_local_directory(tmp_path, bpe_files):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    gpt2 = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="GPT2BPETokenizer", vocab_file=str(bpe_files[0]), merge_file=str(bpe_files[1])
        )
    )
    rust = gpt2._tokenizer
    saved = Tokenizer(models.BPE.from_file(str(bpe_files[0]), str(bpe_files[1])))
    saved.pre_tokenizer, saved.decoder = rust.pre_tokenizer, rust.decoder
    saved.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    for model in (str(tmp_path), str(tmp_path / "tokenizer.json")):
        hf = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=model))
        oracle = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
        assert [hf.tokenize(t) for t in TEXTS] == [oracle.encode(t) for t in TEXTS]
        assert hf.eod == gpt2.eod and hf.vocab_size == gpt2.vocab_size


def test_null_tokenizer_matches_megatron_core():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    ours = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    theirs = NullTokenizer(100)
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod) == (101, 100)
    assert ours.tokenize("3 1 4 1 5") == theirs.text_to_ids("3 1 4 1 5")


@pytest.mark.parametrize(
    "config,flag",
    [
        (TokenizerConfig(tokenizer_type="GPT2BPETokenizer", merge_file="m.txt"), "--vocab-file"),
        (
            TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file="/nope.json", merge_file="m"),
            "--vocab-file",
        ),
        (
            TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/no/such/dir"),
            "--tokenizer-model",
        ),
        (TokenizerConfig(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-type"),
        (TokenizerConfig(tokenizer_type="NullTokenizer"), "--vocab-size"),
    ],
)
def test_missing_files_name_the_flag(config, flag):
    with pytest.raises(ConfigError, match=f"^{flag}"):
        build_tokenizer(config)
