"""Read back what W&B wrote offline: the records of a ``run-<id>.wandb`` file.

wandb 0.31 reads these files only in its Go core (no Python reader ships), so the tests read them
here: the file is a LevelDB-style log (a 7-byte header ':W&B', 0xBEE1, version 0; then 32 KiB blocks of chunks, each
with a CRC-32, a length and a type: full, first, middle, last) of ``wandb.proto`` ``Record``
messages. Every chunk's checksum is verified, so a misread fails loudly rather than passing.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B log ({ident!r}, {magic:#x}, {version})"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        body = data[pos + HEADER:pos + HEADER + n]
        pos += HEADER + n
        if kind == 0 and n == 0:
            continue
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at byte {pos}"
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            yield pending + body


def read_run(path: Path) -> dict[str, Any]:
    """The run's id, its config (as logged) and its history rows (``_step`` and the values)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"id": None, "config": {}, "history": []}
    for body in chunks(path):
        rec = pb.Record()
        rec.ParseFromString(body)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["id"] = rec.run.run_id
            out["config"] |= {u.key: json.loads(u.value_json) for u in rec.run.config.update}
        elif kind == "config":
            out["config"] |= {u.key: json.loads(u.value_json) for u in rec.config.update}
        elif kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return out


def offline_runs(run_dir: Path) -> list[dict[str, Any]]:
    """Every offline run directory of ``run_dir``, oldest first (each job of a run writes one)."""
    return [read_run(f) for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))]
