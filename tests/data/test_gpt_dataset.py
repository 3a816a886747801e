"""GPTDataset, BlendedDataset and the builder yield megatron-core's samples in megatron-core's order
(its C++ helpers are compiled here, so its own GPTDataset runs on CPU as the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.datasets import gpt_dataset as up_gpt
from megatron.core.datasets import helpers_cpp
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder as UpstreamBuilder,
)
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_lite.core.datasets import helpers
from megatron_lite.core.datasets.blended_dataset import BlendedDataset
from megatron_lite.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_lite.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_lite.training.tokenizers import TokenizerConfig, build_tokenizer

VOCAB = 50
TOKENIZER = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB))
SEQ = 16


def _write_corpus(prefix: str, seed: int, docs: int = 120) -> None:
    rng = np.random.RandomState(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(docs):
        n = int(rng.choice([0, 1, 3, 7, 20, 45]))  # empty and one-token documents included
        doc = [*rng.randint(0, VOCAB, n).tolist(), TOKENIZER.eod] if n else []
        builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)] if doc else [])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt")
    paths = [str(root / name) for name in ("a", "b")]
    for seed, path in enumerate(paths):
        _write_corpus(path, seed)
    return paths


def _configs(tmp_path, **kwargs):
    common = dict(
        random_seed=1234, sequence_length=SEQ, tokenizer=TOKENIZER, reset_position_ids=True,
        reset_attention_mask=False, eod_mask_loss=True, **kwargs,
    )  # fmt: skip
    ours = GPTDatasetConfig(path_to_cache=str(tmp_path / "ours"), **common)
    # Upstream's BlendedDataset would ask torch.distributed for a rank to cache: let it not cache.
    theirs = up_gpt.GPTDatasetConfig(
        path_to_cache=None if "blend_per_split" in kwargs or _weighted(kwargs) else str(tmp_path / "theirs"),
        **common,
    )
    return ours, theirs


def _weighted(kwargs) -> bool:
    blend = kwargs.get("blend")
    return blend is not None and (len(blend[0]) > 1 or blend[1] is not None)


def _build_both(tmp_path, sizes, **kwargs):
    ours_cfg, theirs_cfg = _configs(tmp_path, **kwargs)
    ours = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, ours_cfg).build()
    theirs = UpstreamBuilder(up_gpt.GPTDataset, sizes, lambda: True, theirs_cfg).build()
    return ours, theirs


def _assert_same_samples(ours, theirs):
    assert (ours is None) == (theirs is None)
    if ours is None:
        return
    assert len(ours) == len(theirs)
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
            assert torch.equal(a[key], b[key]), (i, key)
        assert a.get("dataset_id") == b.get("dataset_id")


@pytest.mark.parametrize("sizes", [[300, 40, 8], [30, 10, None], [137, 5, 1]])
def test_single_prefix_split_matches_upstream_sample_for_sample(tmp_path, prefixes, sizes):
    ours, theirs = _build_both(tmp_path, sizes, blend=([prefixes[0]], None), split="80,15,5")
    for o, t in zip(ours, theirs):
        _assert_same_samples(o, t)
        if o is not None:
            for name in ("document_index", "sample_index", "shuffle_index"):
                assert np.array_equal(getattr(o, name), getattr(t, name)), name


def test_weighted_blend_matches_upstream(tmp_path, prefixes):
    ours, theirs = _build_both(tmp_path, [120, 20, 0], blend=(prefixes, [0.3, 0.7]), split="90,10,0")
    assert isinstance(ours[0], BlendedDataset) and ours[2] is None
    assert np.array_equal(ours[0].dataset_index, theirs[0].dataset_index)
    for o, t in zip(ours, theirs):
        _assert_same_samples(o, t)


def test_per_split_blends_match_upstream(tmp_path, prefixes):
    blends = [(prefixes, None), ([prefixes[1]], None), None]
    ours, theirs = _build_both(tmp_path, [50, 12, 0], blend_per_split=blends)
    for o, t in zip(ours, theirs):
        _assert_same_samples(o, t)


@pytest.mark.parametrize("extra", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_index_port_equals_the_cpp_helper(extra, drop_last):
    rng = np.random.RandomState(7)
    sizes = rng.choice([0, 1, 2, 5, 16, 17, 40], 60).astype(np.int32)
    sizes[-1] = 9  # the C++ needs a last document to stop in
    documents = np.tile(np.arange(60, dtype=np.int32), 3)
    rng.shuffle(documents)
    tokens = int(sizes.sum())
    ours = helpers.build_sample_idx(sizes, documents, 16, 3, tokens, drop_last, extra)
    theirs = helpers_cpp.build_sample_idx_int32(sizes, documents, 16, 3, tokens, drop_last, int(extra))
    assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


def test_blending_index_ports_equal_the_cpp_helpers():
    weights = [0.2, 0.5, 0.3]
    ours = helpers.build_blending_indices(weights, 3, 500)
    theirs = np.zeros(500, np.int16), np.zeros(500, np.int64)
    helpers_cpp.build_blending_indices(theirs[0], theirs[1], np.array(weights), 3, 500, False)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    sizes = [7, 30, 11]
    ours = helpers.build_exhaustive_blending_indices(sizes)
    theirs = np.zeros(48, np.int16), np.zeros(48, np.int64)
    helpers_cpp.build_exhaustive_blending_indices(theirs[0], theirs[1], np.array(sizes, np.int64), 3)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))


def test_cache_is_reused_for_the_same_config_and_never_for_another(tmp_path, prefixes):
    def build(seed):
        cfg, _ = _configs(tmp_path, blend=([prefixes[0]], None), split="1,0,0")
        cfg.random_seed = seed
        return BlendedMegatronDatasetBuilder(GPTDataset, [60, None, None], lambda: True, cfg).build()[0]

    first = build(1)
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert len(files) == 4 and all(f.startswith(first.unique_description_hash) for f in files)
    again = build(1)
    assert isinstance(again.shuffle_index, np.memmap)  # loaded, not rebuilt
    assert np.array_equal(again.shuffle_index, first.shuffle_index)
    other = build(2)
    assert other.unique_description_hash != first.unique_description_hash
    assert len(list((tmp_path / "ours").iterdir())) == 8 and not list((tmp_path / "ours").glob("*.tmp*"))
    # A description that does not match its files' hash is rebuilt, not trusted.
    (tmp_path / "ours" / f"{first.unique_description_hash}-GPTDataset-train-description.txt").write_text("{}")
    rebuilt = build(1)
    assert not isinstance(rebuilt.shuffle_index, np.memmap)
    assert np.array_equal(rebuilt.shuffle_index, first.shuffle_index)


@pytest.mark.parametrize(
    "content,words",
    [
        (b"garbage", "not a readable index cache"),
        (None, "an index cache of float32 values"),  # another writer's array, not indices
    ],
    ids=["not-an-array", "float-values"],
)
def test_an_unreadable_cache_is_one_line_naming_the_file(tmp_path, prefixes, content, words):
    from megatron_lite.core.datasets.utils import DataFileError

    def build():
        cfg, _ = _configs(tmp_path, blend=([prefixes[0]], None), split="1,0,0")
        return BlendedMegatronDatasetBuilder(GPTDataset, [60, None, None], lambda: True, cfg).build()[0]

    first = build()
    bad = tmp_path / "ours" / f"{first.unique_description_hash}-GPTDataset-train-sample_index.npy"
    if content is None:
        np.save(bad, np.zeros(4, np.float32))
    else:
        bad.write_bytes(content)
    with pytest.raises(DataFileError) as err:
        build()
    assert str(err.value).startswith(f"{bad}: ") and words in str(err.value) and "\n" not in str(err.value)
