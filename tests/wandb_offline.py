"""Read the history of an offline W&B run from its transaction log (run-<id>.wandb).

The file is a 7-byte header (":W&B", magic, version) followed by LevelDB-style log records in 32 KiB
blocks (CRC32, length, type; FULL/FIRST/MIDDLE/LAST), each payload one protobuf ``Record``.
"""

from __future__ import annotations

import json
import struct

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        if BLOCK - (pos % BLOCK) < 7:
            pos += BLOCK - (pos % BLOCK)
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
        else:
            break


def read_history(path: str) -> list[dict]:
    from wandb.proto import wandb_internal_pb2

    rows = []
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            )
    return rows
