"""A Hugging Face model directory's weights: read a slice of one tensor at a time, memory-mapped, and
write them back as sharded ``.safetensors`` files with the index ``transformers`` reads.

Reading opens the tensor's file for that one read: the mapping (and the page cache pages it touched)
is released at once, so a rank's resident memory grows by the slice it keeps, not by the files.
The format cannot hold code: a header of names, dtypes, shapes and offsets, then raw bytes.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open

from megatron_lite.bridge.models.conversion.errors import BridgeError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafeTensorsCheckpoint:
    """The tensors of a model directory: ``model.safetensors`` or the files its index names."""

    def __init__(self, path: str, optional_prefix: str = ""):
        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                raise BridgeError(f"{index}: not a safetensors index (no weight_map)") from None
        elif os.path.exists(os.path.join(path, SINGLE)):
            keys = _opened(os.path.join(path, SINGLE), lambda f: list(f.keys()))
            weight_map = dict.fromkeys(keys, SINGLE)
        else:
            raise BridgeError(f"{path}: holds no {SINGLE} or {INDEX} (only safetensors weights are read)")
        self.files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        # GPT-2's hub files name tensors without the "transformer." its model class adds: add it back
        # (never to the head, which has none) only where a file uses no prefix at all.
        uses_prefix = optional_prefix and any(n.startswith(optional_prefix) for n in self.files)
        self.prefix = "" if uses_prefix else optional_prefix

    def _key(self, name: str) -> str:
        if name in self.files:
            return name
        if self.prefix and name.startswith(self.prefix) and name[len(self.prefix) :] in self.files:
            return name[len(self.prefix) :]
        raise BridgeError(f"{self.path}: has no tensor {name}")

    def names(self) -> set[str]:
        """Every tensor name, with the optional prefix added back where the file left it out."""
        return {self.prefix + n if self.prefix and not n.startswith("lm_head.") else n for n in self.files}

    def shape(self, name: str) -> list[int]:
        key = self._key(name)
        return _opened(self.files[key], lambda f: f.get_slice(key).get_shape())

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) ``[start, stop)`` of a tensor, or all of it: only those bytes
        are copied out of the file."""
        key = self._key(name)

        def take(f):
            sliced = f.get_slice(key)
            if dim is None:
                return sliced[:]
            return sliced[start:stop] if dim == 0 else sliced[:, start:stop]

        return _opened(self.files[key], take)


def _opened(file: str, use):
    """``use(handle)`` on the memory-mapped file, unmapped right after; a missing, truncated or
    corrupt file is one BridgeError line."""
    try:
        with safe_open(file, framework="pt") as f:
            return use(f)
    except Exception as err:  # safetensors' own error type for a corrupt header or a short file
        raise BridgeError(f"{file}: not a readable safetensors file ({str(err).splitlines()[0]})") from None


# safetensors' dtype names.
_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class ShardedWriter:
    """Streams tensors into files of at most ``max_shard_bytes`` (a tensor larger than that gets a file
    of its own), then names them as ``transformers`` does and writes the index.

    A safetensors file starts with a header of every tensor's offsets, so each tensor's bytes go to a
    spool file as they arrive; when the file is full its header is written and the spool copied in
    after it. Memory holds one tensor, never a file's worth.
    """

    def __init__(self, directory: str, max_shard_bytes: int):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self.header: dict[str, dict] = {}
        self.spool = None
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # (temporary file name, its tensors)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.header and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        if self.spool is None:
            self.spool = open(os.path.join(self.directory, f"spool-{len(self.files):05d}"), "w+b")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.spool.write(memoryview(data))
        self.header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self.pending_bytes, self.pending_bytes + size],
        }
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        temp = f"part-{len(self.files):05d}.safetensors"
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the tensors' bytes start 8-aligned, as the reference writer's
        with open(os.path.join(self.directory, temp), "wb") as out:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            if self.spool is not None:
                self.spool.seek(0)
                shutil.copyfileobj(self.spool, out, 16 * 1024**2)
            out.flush()
            os.fsync(out.fileno())
        if self.spool is not None:
            self.spool.close()
            os.remove(self.spool.name)
        self.files.append((temp, list(self.header)))
        self.header, self.spool, self.pending_bytes = {}, None, 0

    def close(self) -> list[str]:
        """Write what is pending, give the files their final names; returns those names."""
        if self.header or not self.files:
            self._flush()
        count = len(self.files)
        names = (
            [SINGLE]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        weight_map = {}
        for (temp, tensors), final in zip(self.files, names):
            os.replace(os.path.join(self.directory, temp), os.path.join(self.directory, final))
            weight_map.update(dict.fromkeys(tensors, final))
        if count > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            }
            with open(os.path.join(self.directory, INDEX), "w") as f:
                json.dump(index, f, indent=2)
        return names
