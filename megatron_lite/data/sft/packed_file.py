"""The offline packs' file (tools/prepare_sft_data.py writes it, ``--sft --data-path`` reads it): one
safetensors file, so loading it runs no code (no pickle).

Tensors: ``ids`` (int32) and ``answer`` (uint8) of every example one after another, ``offsets``
(int64 [n + 1]) where each example starts, ``pack_members`` (int64) the example indices of every pack
one after another and ``pack_offsets`` (int64 [packs + 1]) where each pack's start. The string
metadata says what the packs were made for: ``format``, ``version``, ``seq_length``,
``pad_seq_to_mult``, ``packing_algorithm``, ``seed``, ``tokenizer`` (its identifiers, JSON) and
``source`` (the JSONL it was made from). The file is written beside itself and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from megatron_lite.data.sft.dataset import TokenizedExamples
from megatron_lite.training.errors import ConfigError

FORMAT = "megatron_lite.sft_packs"
VERSION = "1"
SUFFIX = ".safetensors"


def is_packed_file(path: str) -> bool:
    return path.endswith(SUFFIX)


def save_packs(path: str, examples: TokenizedExamples, packs, metadata: dict[str, object]) -> None:
    """Write ``examples`` and ``packs`` (lists of example indices) to ``path`` atomically."""
    pack_offsets = np.zeros(len(packs) + 1, np.int64)
    np.cumsum([len(p) for p in packs], out=pack_offsets[1:])
    members = np.asarray([i for p in packs for i in p], np.int64)
    tensors = {
        "ids": examples.ids,
        "answer": examples.answer,
        "offsets": examples.offsets,
        "pack_members": members,
        "pack_offsets": pack_offsets,
    }
    meta = {"format": FORMAT, "version": VERSION, **{k: str(v) for k, v in metadata.items()}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        _write_safetensors(tmp, tensors, meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


_DTYPES = {np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8"}


def _write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """The safetensors layout with its header's keys sorted: safetensors' own writer orders the
    metadata by a hash map, which would make the same packs two different files."""
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset, blobs = 0, []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        blob = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": _DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for blob in blobs:
            f.write(blob)


def load_packs(path: str) -> tuple[TokenizedExamples, list[list[int]], dict[str, str]]:
    """The examples, packs and metadata of a file ``save_packs`` wrote; ConfigError naming the file
    for anything else."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ConfigError("--data-path", f"{path}: not an SFT pack file (tools/prepare_sft_data.py)")
            if meta.get("version") != VERSION:
                raise ConfigError(
                    "--data-path", f"{path}: pack file version {meta.get('version')} (want {VERSION})"
                )
            t = {k: f.get_tensor(k) for k in ("ids", "answer", "offsets", "pack_members", "pack_offsets")}
    except (OSError, SafetensorError) as err:
        raise ConfigError("--data-path", f"{path}: cannot be read as a pack file ({err})") from None
    examples = TokenizedExamples(t["ids"], t["answer"], t["offsets"])
    bounds, members = t["pack_offsets"], t["pack_members"]
    packs = [members[bounds[i] : bounds[i + 1]].tolist() for i in range(len(bounds) - 1)]
    if examples.offsets[-1] != len(examples.ids) or (len(members) and members.max() >= len(examples)):
        raise ConfigError("--data-path", f"{path}: the pack file is inconsistent (truncated or edited?)")
    return examples, packs, meta


def tokenizer_identity(tokenizer) -> str:
    """What a pack file records of its tokenizer, to refuse one made with another: its class and a
    digest of its files (vocabulary, merges, tokenizer.json and the chat template's config), not
    their paths, so a file moves between machines."""
    identifiers = dict(getattr(tokenizer, "unique_identifiers", {}))
    digest = hashlib.sha256()
    for key in sorted(k for k in identifiers if k != "class"):
        path = identifiers[key]
        files = [os.path.join(path, n) for n in _TOKENIZER_FILES] if os.path.isdir(path) else [path]
        for name in files:
            if os.path.isfile(name):
                with open(name, "rb") as f:
                    digest.update(os.path.basename(name).encode() + b"\0" + f.read())
            elif not os.path.isdir(path):
                digest.update(f"{key}={path}".encode())  # not a file (a NullTokenizer's size)
    return f"{identifiers.get('class')}:{digest.hexdigest()[:16]}"


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
