"""Megatron's indexed dataset: token ids in a ``.bin`` file, their layout in an ``.idx`` file.

The format is megatron-core's, byte for byte, so either side reads what the other wrote:

``.idx`` = header ``b"MMIDIDX\\x00\\x00"``, version ``<Q`` 1, dtype code ``<B``, sequence count ``<Q``,
document count ``<Q`` (the document indices including their leading 0), then the sequence lengths
(int32), the byte offset of each sequence in ``.bin`` (int64), the document indices (int64: the
sequence index where each document ends) and, for multimodal data only, one int8 mode per sequence.
``.bin`` = every sequence's tokens, back to back, in the dtype the code names.
"""

from __future__ import annotations

import os
import shutil
import struct
from enum import Enum

import numpy
import torch

from megatron_lite.core.datasets.utils import DataFileError

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8


class DType(Enum):
    """NumPy dtypes of the token ids and their one-byte codes in the ``.idx`` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: type[numpy.number]) -> int:
        return cls[numpy.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> type[numpy.number]:
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: int | type[numpy.number]) -> int:
        """Bytes per element of a dtype or dtype code."""
        if isinstance(key, int):
            return numpy.dtype(DType.dtype_from_code(key)).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: int | None) -> type[numpy.number]:
        """uint16 when every id fits (upstream's threshold), else int32."""
        return numpy.uint16 if cardinality is not None and cardinality < 65500 else numpy.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


class _IndexReader:
    """The arrays of one ``.idx`` file, memory-mapped (nothing is copied)."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES or header[:9] != _INDEX_HEADER:
            raise DataFileError(f"bad header, cannot read: {idx_path}")
        version, code, self.sequence_count, self.document_count = struct.unpack("<QBQQ", header[9:])
        if version != 1:
            raise DataFileError(f"bad version {version}, cannot read: {idx_path}")
        if code not in {c.value for c in DType}:
            raise DataFileError(f"{idx_path}: unknown dtype code {code}; the file is corrupt")
        self.dtype = DType.dtype_from_code(code)
        self.dtype_size = DType.size(self.dtype)
        # The header's counts fix the file's size: a truncated or corrupt index is caught here, not
        # as a numpy error (or a wild read) later.
        n, size = self.sequence_count, os.path.getsize(idx_path)
        expected = _HEADER_BYTES + n * (4 + 8) + self.document_count * 8
        if size not in (expected, expected + n):  # + n: a multimodal index's modes, read or not
            raise DataFileError(
                f"{idx_path}: {size} bytes, but its header's {n} sequences and {self.document_count} "
                f"documents take {expected + (n if multimodal else 0)}; the file is truncated or corrupt"
            )
        buffer = numpy.memmap(idx_path, mode="r", order="C")
        n, offset = self.sequence_count, _HEADER_BYTES
        self.sequence_lengths = numpy.frombuffer(buffer, numpy.int32, n, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = numpy.frombuffer(buffer, numpy.int64, n, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = numpy.frombuffer(buffer, numpy.int64, self.document_count, offset)
        offset += self.document_indices.nbytes
        self.sequence_modes = numpy.frombuffer(buffer, numpy.int8, n, offset) if multimodal else None

    def __len__(self) -> int:
        return self.sequence_count


class IndexedDataset(torch.utils.data.Dataset):
    """Read-only view of ``path_prefix.bin`` / ``path_prefix.idx``; item ``i`` is sequence ``i``'s
    tokens (with its mode when ``multimodal``). ``mmap=False`` reads each item with a file read."""

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        super().__init__()
        self.initialize(path_prefix, multimodal, mmap)

    def initialize(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        if not (os.path.exists(idx_path) and os.path.exists(bin_path)):
            raise FileNotFoundError(
                f"One or both of the .idx and .bin files cannot be found at the path prefix {path_prefix}"
            )
        self.path_prefix, self.multimodal, self.mmap = path_prefix, multimodal, mmap
        self.index = _IndexReader(idx_path, multimodal)
        index = self.index
        if index.document_count == 0 or index.document_indices[-1] != len(index):
            raise DataFileError(f"{idx_path}: document indices do not end at the sequence count")
        needed = (
            int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
            if len(index)
            else 0
        )
        size = os.path.getsize(bin_path)
        if size < needed:
            raise DataFileError(
                f"{bin_path}: {size} bytes, but {idx_path} indexes {needed}; "
                "the .bin is truncated or belongs to another index"
            )
        self._bin = numpy.memmap(bin_path, mode="r", order="C") if mmap and needed else None

    def check(self) -> None:
        """Every sequence inside the .bin and the document indices in order: DataFileError naming the
        file otherwise. Reads the whole index (vectorised), so it runs once, where the run's input is
        validated, not on every open."""
        index, idx_path = self.index, get_idx_path(self.path_prefix)
        lengths, pointers = index.sequence_lengths, index.sequence_pointers
        ends = pointers + lengths.astype(numpy.int64) * index.dtype_size
        bin_size = os.path.getsize(get_bin_path(self.path_prefix))
        if len(index) and (lengths.min() < 0 or pointers.min() < 0 or ends.max() > bin_size):
            raise DataFileError(
                f"{idx_path}: a sequence lies outside {get_bin_path(self.path_prefix)} ({bin_size} bytes); "
                "the index is corrupt or belongs to another .bin"
            )
        docs = index.document_indices
        if docs[0] != 0 or (numpy.diff(docs) < 0).any():
            raise DataFileError(f"{idx_path}: document indices out of order; the file is corrupt")

    def __getstate__(self):
        return (self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state) -> None:
        self.initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def _read(self, count: int, offset: int) -> numpy.ndarray:
        dtype = self.index.dtype
        if self._bin is not None:
            return numpy.frombuffer(self._bin, dtype=dtype, count=count, offset=offset)
        with open(get_bin_path(self.path_prefix), "rb") as f:
            f.seek(offset)
            return numpy.frombuffer(f.read(count * self.index.dtype_size), dtype=dtype)

    def __getitem__(self, idx):
        if isinstance(idx, (int, numpy.integer)):
            return self.get(int(idx))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("Slices into indexed_dataset must be contiguous")
            lengths = self.index.sequence_lengths[start:stop]
            pointer = self.index.sequence_pointers[start] if stop > start else 0
            flat = self._read(int(lengths.sum()), int(pointer))
            sequences = numpy.split(flat, numpy.cumsum(lengths)[:-1])
            if self.multimodal:
                return sequences, self.index.sequence_modes[start:stop]
            return sequences
        raise TypeError(f"Unexpected type received for idx: {type(idx)}")

    def get(self, idx: int, offset: int = 0, length: int | None = None):
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        pointer, size = self.index.sequence_pointers[idx], self.index.sequence_lengths[idx]
        length = size - offset if length is None else length
        tokens = self._read(int(length), int(pointer) + int(offset) * self.index.dtype_size)
        return (tokens, self.index.sequence_modes[idx]) if self.multimodal else tokens

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    def get_document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    @property
    def sequence_modes(self) -> numpy.ndarray:
        if self.index.sequence_modes is None:
            raise ValueError("not a multimodal dataset")
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes a ``.bin`` as items arrive and the matching ``.idx`` at :meth:`finalize`.

    Sequences are streamed to disk; only their lengths (and modes) stay in memory.
    """

    def __init__(self, bin_path: str, dtype: type[numpy.number] = numpy.int32, multimodal: bool = False):
        self.data_file = open(bin_path, "wb")  # noqa: SIM115 - closed by finalize
        self.dtype, self.multimodal = dtype, multimodal
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.sequence_modes: list[int] | None = [] if multimodal else None

    def add_item(self, tensor, mode: int = 0) -> None:
        """Append one sequence (end the document with :meth:`end_document`)."""
        array = numpy.asarray(
            tensor.numpy() if isinstance(tensor, torch.Tensor) else tensor, dtype=self.dtype
        )
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(self, tensor, lengths: list[int], modes: list[int] | None = None) -> None:
        """Append a whole document: ``tensor`` holds its sequences back to back, of ``lengths``."""
        array = numpy.asarray(tensor, dtype=self.dtype)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def add_documents(self, tokens, document_lengths) -> None:
        """Append many one-sequence documents at once (megatron_lite's bulk form of add_document):
        ``tokens`` holds them back to back; a length of 0 is an empty document with no sequence."""
        array = numpy.asarray(tokens, dtype=self.dtype)
        lengths = numpy.asarray(document_lengths, dtype=numpy.int64)
        self.data_file.write(array.tobytes(order="C"))
        start = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths[lengths > 0].tolist())
        self.document_indices.extend((start + numpy.cumsum(lengths > 0)).tolist())
        if self.multimodal:
            self.sequence_modes.extend([0] * int((lengths > 0).sum()))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of another indexed dataset of the same dtype."""
        index = _IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        if index.dtype != self.dtype:
            raise ValueError(f"{path_prefix}: dtype {index.dtype.__name__} != {self.dtype.__name__}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(index.sequence_lengths.tolist())
        self.document_indices.extend((offset + index.document_indices[1:]).tolist())
        if self.multimodal:
            self.sequence_modes.extend(index.sequence_modes.tolist())
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file)

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self.data_file.close()
        lengths = numpy.asarray(self.sequence_lengths, dtype=numpy.int32)
        pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
        numpy.cumsum(lengths[:-1].astype(numpy.int64) * DType.size(self.dtype), out=pointers[1:])
        header = _INDEX_HEADER + struct.pack(
            "<QBQQ", 1, DType.code_from_dtype(self.dtype), len(lengths), len(self.document_indices)
        )
        with open(idx_path, "wb") as f:
            f.write(header)
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(numpy.asarray(self.document_indices, dtype=numpy.int64).tobytes(order="C"))
            if self.multimodal:
                f.write(numpy.asarray(self.sequence_modes, dtype=numpy.int8).tobytes(order="C"))
