"""A model brought into rlbatch's model cache once: a GGUF file, a local Hugging Face directory or
a bundled model's name in, the Hugging Face directory every engine loads (``model.path``) out.

Each import is one directory of the cache, ``<cache>/<name>-<key>``: ``name`` from the source's
file or directory name, ``key`` a hash of what the source is (each file's name, size and
modification time), the import's format and the dtype asked for. Writing anything to the source
changes its key, so a changed source is imported again; an unchanged one is found and returned
without work. A directory is complete once it exists: it is written under a hidden name beside
it and renamed last, with ``rlbatch-import.json`` (the source, its key, what was converted) inside.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbatch.config.parse import CHOICES
from rlbatch.errors import ConfigError
from rlbatch.models.bundled import BUNDLED, bundled_gguf
from rlbatch.models.gguf_header import GgufHeader, read_gguf_header
from rlbatch.models.spec import spec_from_hf_config

FORMAT = 1
"""Changes when the same source would be imported differently: part of every key."""
RECORD = "rlbatch-import.json"
ENGINE_ARCHS: tuple[str, ...] = CHOICES["model.arch"]
"""transformers model_types rlbatch's engines run."""
GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen2moe": "qwen2_moe"}
"""GGUF ``general.architecture`` -> transformers model_type, for the architectures rlbatch runs."""


@dataclass(frozen=True)
class Imported:
    path: Path
    """The model directory: what ``model.path`` names."""
    cached: bool
    """Found in the cache; nothing was converted."""
    record: dict[str, Any]
    """The contents of its rlbatch-import.json."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/rlbatch/models``, ``~/.cache/rlbatch/models`` without it."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "rlbatch" / "models"


def _refuse_arch(source: Path, arch: str, where: str) -> ConfigError:
    return ConfigError(f"source: {source} holds a {arch!r} model ({where}); rlbatch imports {', '.join(ENGINE_ARCHS)} "
                       f"(the architectures its engines run, model.arch)")


def check_gguf(path: Path) -> GgufHeader:
    """The header of the GGUF file ``path``, after refusing what cannot be imported: an
    architecture rlbatch's engines do not run or transformers' GGUF loader does not read, a split
    file, a file without a tokenizer."""
    header = read_gguf_header(path)
    arch = header.architecture
    model_type = GGUF_MODEL_TYPES.get(arch, arch)
    if model_type not in ENGINE_ARCHS:
        raise _refuse_arch(path, arch, "GGUF general.architecture")
    if int(header.metadata.get("split.count", 1)) > 1:
        raise ConfigError(f"source: {path} is one part of a split GGUF model ({header.metadata['split.count']} "
                          f"files); merge the parts first (llama.cpp's `llama-gguf-split --merge`)")
    if "tokenizer.ggml.model" not in header.metadata:
        raise ConfigError(f"source: {path} carries no tokenizer (no tokenizer.ggml.model in its metadata)")
    from rlbatch.models.gguf_convert import transformers_reads

    if not transformers_reads(arch, model_type):
        import transformers

        raise ConfigError(f"source: {path} holds a {arch!r} model, which transformers {transformers.__version__}'s "
                          f"GGUF loader does not read")
    return header


def source_key(files: list[Path], root: Path, kind: str, dtype: str) -> str:
    """16 hex digits of a hash of ``files`` (their names under ``root``, sizes and modification
    times), ``kind``, ``dtype`` and ``FORMAT``."""
    stats = [(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    text = json.dumps({"format": FORMAT, "kind": kind, "dtype": dtype, "files": stats})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _entry_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.")[:80] or "model"


def _readable(out: Path) -> None:
    """Give the files the umask's permissions: some writers make theirs private (0600), and a cache
    on a shared filesystem is read by every job of its users."""
    umask = os.umask(0o022)
    os.umask(umask)
    out.chmod(0o777 & ~umask)
    for p in out.iterdir():
        p.chmod(0o666 & ~umask)


def _resolve(source: str) -> Path:
    path = Path(source).expanduser()
    if not path.exists() and source in BUNDLED:
        return bundled_gguf(source)
    if not path.exists():
        raise ConfigError(f"source: {source!r} does not exist; give a .gguf file, a local Hugging Face model "
                          f"directory, or a bundled model ({', '.join(sorted(BUNDLED))})")
    return path.resolve()


def import_model(source: str, cache_dir: Path | None = None, dtype: str | None = None) -> Imported:
    """The model directory of ``source`` in ``cache_dir`` (``default_cache_dir()`` when None),
    imported now unless it is there already. ``dtype`` (fp32 when None): the dtype a GGUF file's
    dequantised weights are written in; a directory's weights are copied as they are."""
    from rlbatch.models.gguf_convert import DTYPES

    path = _resolve(source)
    if path.is_dir():
        if dtype is not None:
            raise ConfigError(f"dtype: {dtype!r} applies to GGUF files; the weights of a directory ({path}) are "
                              f"copied in their own dtype")
        kind, files, name = "hf", sorted(p for p in path.iterdir() if p.is_file()), path.name
    else:
        dtype = dtype or "fp32"
        if dtype not in DTYPES:
            raise ConfigError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        kind, files, name = "gguf", [path], path.name.removesuffix(".gguf")
    cache = (cache_dir or default_cache_dir()).expanduser()
    root = path if kind == "hf" else path.parent
    final = cache / f"{_entry_name(name)}-{source_key(files, root, kind, dtype or 'as-is')}"
    if (final / RECORD).is_file():  # checked and converted before: no work
        return Imported(final, True, json.loads((final / RECORD).read_text()))
    if kind == "hf":
        from rlbatch.models.hf_copy import model_type

        if (found := model_type(path)) not in ENGINE_ARCHS:
            raise _refuse_arch(path, found or "unnamed", "config.json model_type")
    else:
        header = check_gguf(path)
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=cache))
    try:
        start = time.monotonic()
        out = work / "model"
        if kind == "gguf":
            from rlbatch.models.gguf_convert import convert_gguf

            facts = convert_gguf(path, out, dtype or "fp32", header.metadata)
        else:
            from rlbatch.models.hf_copy import copy_hf_dir

            facts = copy_hf_dir(path, out)
        record = {"source": str(path), "kind": kind, "key": final.name.rsplit("-", 1)[1], "format": FORMAT,
                  "seconds": round(time.monotonic() - start, 1), **facts}
        spec_from_hf_config(json.loads((out / "config.json").read_text()), name=final.name)  # rlbatch reads it
        (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _readable(out)
        try:
            out.rename(final)
        except OSError:  # another import of the same source finished first: its directory is the same model
            if not (final / RECORD).is_file():
                raise
            return Imported(final, True, json.loads((final / RECORD).read_text()))
        return Imported(final, False, record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
