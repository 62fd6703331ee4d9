"""The metadata at the head of a GGUF file, read with the standard library alone (no gguf package,
no torch): what ``rlbatch.models.importer`` checks before it converts anything.

A GGUF file (llama.cpp's format, version 2 or 3, little-endian) starts with the magic ``GGUF``, a
version, the number of tensors and the number of key/value pairs; each pair is a key (a string),
a value type and a value. Scalars and strings are kept; an array is kept as its length (a
vocabulary of 150k tokens is not needed to tell the architecture).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rlbatch.errors import ConfigError

MAGIC = b"GGUF"

_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                            10: "<Q", 11: "<q", 12: "<d"}
"""GGUF value type -> struct format; 8 is a string, 9 an array."""
_STRING, _ARRAY = 8, 9

Scalar = int | float | bool | str


@dataclass(frozen=True)
class GgufHeader:
    version: int
    tensors: int
    metadata: dict[str, Scalar]
    """Each key's value; an array's value is its length."""

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Reader:
    def __init__(self, f: BinaryIO, name: str, size: int) -> None:
        self.f, self.name, self.size = f, name, size

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ConfigError(f"source: {self.name} ends inside its GGUF header; the file is truncated or not GGUF")
        return data

    def unpack(self, fmt: str) -> Scalar:
        value: Scalar = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def string(self) -> str:
        n = int(self.unpack("<Q"))
        if n > self.size:
            raise ConfigError(f"source: {self.name} has a GGUF string of {n} bytes, longer than the file")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Scalar:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = int(self.unpack("<I")), int(self.unpack("<Q"))
            if item in _SCALARS:
                self.f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
            else:  # strings (or nested arrays): each has its own length
                for _ in range(count):
                    self.value(item)
            return count
        raise ConfigError(f"source: {self.name} has a GGUF value of unknown type {kind}; not a GGUF file rlbatch reads")


def read_gguf_header(path: Path) -> GgufHeader:
    """The version, tensor count and metadata of the GGUF file at ``path``; a ConfigError naming
    the file when it is not one."""
    size = path.stat().st_size
    with path.open("rb") as f:
        r = _Reader(f, str(path), size)
        if f.read(4) != MAGIC:
            raise ConfigError(f"source: {path} is not a GGUF file (it does not start with {MAGIC!r})")
        version = int(r.unpack("<I"))
        if version not in (2, 3):
            raise ConfigError(f"source: {path} is GGUF version {version}; rlbatch reads versions 2 and 3 "
                              f"(little-endian)")
        tensors, pairs = int(r.unpack("<Q")), int(r.unpack("<Q"))
        metadata: dict[str, Scalar] = {}
        for _ in range(pairs):
            key = r.string()
            metadata[key] = r.value(int(r.unpack("<I")))
    return GgufHeader(version=version, tensors=tensors, metadata=metadata)
