"""A reader of DCP's ``.metadata`` that runs no code from the file.

DCP's own ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load``, which can run code; here
it goes through an unpickler that builds DCP's metadata classes, torch sizes and dtypes only. The
tensors themselves DCP reads with torch's weights-only unpickler.
"""

from __future__ import annotations

import pickle
import re

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP = "torch.distributed.checkpoint."
# Exactly the classes DCP's own .metadata (and megatron-core's, with its cached save plans) is made of.
_CLASSES = {
    f"{_DCP}metadata": (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ),
    f"{_DCP}filesystem": ("_StorageInfo",),
    f"{_DCP}planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "pathlib": ("PosixPath", "PurePosixPath"),  # the checkpoint_id DCP records
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler, limited to ``_CLASSES``, torch.Size, torch's dtype / layout /
    memory-format values and ``_get_layout`` (a layout by its name); BUILD (setting an object's state)
    only on instances of those classes, never on a class itself."""

    def find_class(self, module: str, name: str):
        if name in _CLASSES.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), _TORCH_VALUES)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")

    def load_build(self) -> None:
        target = self.stack[-2]  # under the state BUILD pops
        allowed = _CLASSES.get(type(target).__module__, ())
        if isinstance(target, type) or type(target).__name__ not in allowed:
            raise pickle.UnpicklingError(f"setting the state of a {type(target).__name__} is not allowed")
        super().load_build()

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build}


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, with ``.metadata`` read through ``_MetadataUnpickler`` and every data file it
    names checked to be one of this directory's ``__<rank>_<n>.distcp``; ``metadata``: what an
    earlier ``read_metadata`` returned, so a load does not read the file again."""

    def __init__(self, path, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is not None:
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
        for info in (metadata.storage_data or {}).values():
            if not _DATA_FILE.fullmatch(str(getattr(info, "relative_path", ""))):
                raise pickle.UnpicklingError(
                    f".metadata names a data file {getattr(info, 'relative_path', None)!r}"
                )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
