"""IndexedDataset / IndexedDatasetBuilder are byte-compatible with megatron-core's, both directions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.datasets import indexed_dataset as upstream

from megatron_lite.core.datasets import indexed_dataset as ours

DOCS = [[[5, 6, 7], [8]], [[9, 10, 11, 12]], [[1]], [[2, 3], [4, 4, 4], [0]]]  # sequences per document


def _write(module, prefix: str, dtype, multimodal: bool = False) -> None:
    builder = module.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for d, doc in enumerate(DOCS):
        for s, seq in enumerate(doc):
            if multimodal:
                builder.add_item(torch.tensor(seq), mode=(d + s) % 3)
            else:
                builder.add_item(torch.tensor(seq))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _read_all(dataset) -> list[list[int]]:
    return [np.asarray(dataset[i]).tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_same_input_gives_identical_bytes(tmp_path, dtype):
    _write(ours, str(tmp_path / "ours"), dtype)
    _write(upstream, str(tmp_path / "theirs"), dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()


def test_multimodal_files_are_identical(tmp_path):
    _write(ours, str(tmp_path / "ours"), np.int32, multimodal=True)
    _write(upstream, str(tmp_path / "theirs"), np.int32, multimodal=True)
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "theirs.idx").read_bytes()
    a = ours.IndexedDataset(str(tmp_path / "theirs"), multimodal=True)
    b = upstream.IndexedDataset(str(tmp_path / "ours"), multimodal=True)
    assert a.sequence_modes.tolist() == b.index.sequence_modes.tolist()
    assert a[3][1] == b[3][1]


@pytest.mark.parametrize("writer,reader", [(ours, upstream), (upstream, ours)])
def test_each_reads_what_the_other_wrote(tmp_path, writer, reader):
    prefix = str(tmp_path / "data")
    _write(writer, prefix, np.uint16)
    dataset = reader.IndexedDataset(prefix)
    assert _read_all(dataset) == [seq for doc in DOCS for seq in doc]
    assert dataset.document_indices.tolist() == [0, 2, 3, 4, 7]
    assert dataset.sequence_lengths.tolist() == [3, 1, 4, 1, 2, 3, 1]
    assert dataset.get(2, offset=1, length=2).tolist() == [10, 11]
    assert [s.tolist() for s in dataset[1:4]] == [[8], [9, 10, 11, 12], [1]]


@pytest.mark.parametrize("mmap", [True, False])
def test_reading_without_mmap_matches(tmp_path, mmap):
    prefix = str(tmp_path / "data")
    _write(upstream, prefix, np.int32)
    assert _read_all(ours.IndexedDataset(prefix, mmap=mmap)) == _read_all(upstream.IndexedDataset(prefix))


def test_add_index_merges_like_upstream(tmp_path):
    for name in ("a", "b"):
        _write(ours, str(tmp_path / name), np.uint16)
    for module, out in ((ours, "ours"), (upstream, "theirs")):
        builder = module.IndexedDatasetBuilder(str(tmp_path / f"{out}.bin"), dtype=np.uint16)
        builder.add_index(str(tmp_path / "a"))
        builder.add_index(str(tmp_path / "b"))
        builder.finalize(str(tmp_path / f"{out}.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()


def test_dtype_codes_match_upstream():
    for dtype in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16):
        assert ours.DType.code_from_dtype(dtype) == upstream.DType.code_from_dtype(dtype)
    assert ours.DType.optimal_dtype(50257) is upstream.DType.optimal_dtype(50257)
    assert ours.DType.optimal_dtype(128256) is upstream.DType.optimal_dtype(128256)


def test_bad_header_is_refused(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" + bytes(40))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="bad header"):
        ours.IndexedDataset(str(tmp_path / "x"))


def test_bulk_add_documents_writes_what_upstream_add_document_writes(tmp_path):
    docs = [[3, 4], [], [5], [6, 7, 8]]
    bulk = ours.IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), dtype=np.uint16)
    bulk.add_documents(np.array([t for d in docs for t in d]), [len(d) for d in docs])
    bulk.finalize(str(tmp_path / "bulk.idx"))
    one_by_one = upstream.IndexedDatasetBuilder(str(tmp_path / "one.bin"), dtype=np.uint16)
    for d in docs:
        one_by_one.add_document(torch.tensor(d, dtype=torch.int64), [len(d)] if d else [])
    one_by_one.finalize(str(tmp_path / "one.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"bulk{ext}").read_bytes() == (tmp_path / f"one{ext}").read_bytes()


def _one_document(tmp_path):
    builder = ours.IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    builder.add_document(torch.arange(100), [100])
    builder.finalize(str(tmp_path / "x.idx"))
    return tmp_path / "x.idx", tmp_path / "x.bin"


@pytest.mark.parametrize(
    "damage,words",
    [
        (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:40]), "the file is truncated or corrupt"),
        (
            lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:18] + b"\xff" * 8 + idx.read_bytes()[26:]),
            "header's",
        ),
        (
            lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:17] + b"\x63" + idx.read_bytes()[18:]),
            "dtype code 99",
        ),
        (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:50]), "the .bin is truncated"),
    ],
    ids=["truncated-idx", "corrupt-count", "corrupt-dtype", "truncated-bin"],
)
def test_a_damaged_index_or_bin_is_one_line_naming_the_file(tmp_path, damage, words):
    idx, bin_ = _one_document(tmp_path)
    damage(idx, bin_)
    with pytest.raises(ValueError) as err:
        ours.IndexedDataset(str(tmp_path / "x"))
    message = str(err.value)
    assert words in message and "\n" not in message and (str(idx) in message or str(bin_) in message)


def test_check_finds_a_corrupt_sequence_in_the_middle(tmp_path):
    """Opening looks at the header and the last sequence only; check() (run once, when the run's
    input is validated) reads every sequence's extent and the document order."""
    builder = ours.IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    for n in (10, 20, 30):
        builder.add_document(torch.arange(n), [n])
    builder.finalize(str(tmp_path / "x.idx"))
    ours.IndexedDataset(str(tmp_path / "x")).check()
    idx = tmp_path / "x.idx"
    header = 9 + 8 + 1 + 8 + 8
    data = bytearray(idx.read_bytes())
    data[header : header + 4] = np.int32(-5).tobytes()  # the first sequence's length
    idx.write_bytes(bytes(data))
    dataset = ours.IndexedDataset(str(tmp_path / "x"))
    with pytest.raises(ValueError, match="a sequence lies outside .*x.bin"):
        dataset.check()
