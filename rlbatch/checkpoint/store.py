"""Atomic, verified checkpoint directories under ``<run_dir>/checkpoints/``.

A checkpoint is written into a staging directory ``step_000012.tmp-<nonce>`` that every rank
writes into (run dirs live on a shared filesystem). One process then commits it: it checksums
every file, writes ``manifest.json`` last, fsyncs, and renames the directory to ``step_000012``.
A directory named ``step_<n>`` whose manifest matches its files is therefore complete; anything
else (a ``.tmp-*`` dir, a missing manifest, a truncated or changed file) is skipped with a
warning when looking for the checkpoint to resume from, in favour of the previous one.

    store = CheckpointStore(run_dir / "checkpoints", keep=3)
    stage = store.begin(step)            # controller; every rank then writes into `stage`
    ...                                  # the caller waits until every rank has written
    store.commit(step, {"run_dir": str(run_dir)})
    ckpt = store.resolve(cfg.resume)     # 'auto' | 'never' | a checkpoint or run dir
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from rlbatch.checkpoint.files import CHECKPOINTS, MANIFEST, fsync_dir
from rlbatch.errors import ConfigError

log = logging.getLogger(__name__)

FORMAT, VERSION = "rlbatch-checkpoint", 1
_DONE = re.compile(r"^step_(\d+)$")
_TMP = re.compile(r"^step_(\d+)\.tmp-[0-9A-Za-z-]+$")
CHUNK = 8 << 20
PROGRESS_MIN_BYTES = 1 << 30
"""Checkpoints at least this big log hashing progress (every PROGRESS_EVERY_S seconds)."""
PROGRESS_EVERY_S = 10.0
HASH_THREADS = 8


class FileEntry(TypedDict):
    """A file of a checkpoint, as its manifest records it."""

    size: int
    sha256: str


class Manifest(TypedDict):
    """manifest.json, written last by ``CheckpointStore.commit``: what makes a checkpoint complete."""

    format: str
    version: int
    step: int
    time: float
    created: str
    meta: dict[str, str]
    """What the writer said about it (the run dir, why it was saved)."""
    files: dict[str, FileEntry]
    """Every other file, by path relative to the checkpoint."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message names the directory, the file and why."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    meta: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Scan:
    """The newest usable checkpoint, and why each newer candidate was passed over."""

    checkpoint: Checkpoint | None
    skipped: list[str]


def step_name(step: int) -> str:
    return f"step_{step:06d}"


class _Progress:
    """Thread-safe byte counter that logs now and then while a big checkpoint is hashed."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if self.total >= PROGRESS_MIN_BYTES and now - self.last >= PROGRESS_EVERY_S:
                self.last = now
                rate = self.done / max(now - self.start, 1e-9)
                log.info("%s: %.1f / %.1f GiB (%.0f%%, %.2f GiB/s)", self.label, self.done / 2**30,
                         self.total / 2**30, 100 * self.done / self.total, rate / 2**30)

    def finish(self) -> None:
        if self.total >= PROGRESS_MIN_BYTES:
            log.info("%s: %.1f GiB in %.1f s", self.label, self.total / 2**30, time.monotonic() - self.start)


def _digest(path: Path, progress: _Progress, fsync: bool = False) -> str:
    """sha256 of a file, read in chunks (hashlib and reads release the GIL: threads overlap)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            progress.add(len(chunk))
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _digests(root: Path, rels: list[str], label: str, fsync: bool = False) -> dict[str, str]:
    progress = _Progress(label, sum((root / r).stat().st_size for r in rels))
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(rels)))) as pool:
        out = dict(zip(rels, pool.map(lambda r: _digest(root / r, progress, fsync), rels), strict=True))
    progress.finish()
    return out


def _files(root: Path) -> list[str]:
    """Every regular file under root (dotfiles such as DCP's ``.metadata`` included), sorted."""
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            out.append((Path(dirpath) / n).relative_to(root).as_posix())
    return sorted(out)


def read_manifest(path: Path) -> Manifest:
    """The parsed manifest of a checkpoint directory; CheckpointError saying what is wrong."""
    mf = path / MANIFEST
    if not mf.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (the write was interrupted before its commit)")
    try:
        manifest: Manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {MANIFEST} is unreadable ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: {MANIFEST} is not an {FORMAT} manifest")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: manifest version {manifest.get('version')} is newer than this rlbatch ({VERSION})")
    return manifest


def check_checkpoint(path: Path, verify: bool = True) -> Checkpoint:
    """A complete checkpoint at ``path``, or CheckpointError naming the file and the problem.

    Always checks that every file of the manifest exists with its size; ``verify`` also compares
    sha256 checksums (reads everything once; progress is logged for big checkpoints).
    """
    path = Path(path)
    manifest = read_manifest(path)
    m = _DONE.match(path.name)
    if m and int(m.group(1)) != manifest.get("step"):
        raise CheckpointError(f"{path}: manifest says step {manifest.get('step')}, directory name says {int(m.group(1))}")
    files = manifest["files"]
    for rel, rec in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: {rel} is missing")
        size = f.stat().st_size
        if size != rec["size"]:
            raise CheckpointError(f"{path}: {rel} has {size} bytes, the manifest says {rec['size']} (truncated or changed)")
    if verify:
        got = _digests(path, list(files), f"verifying {path.name}")
        for rel, rec in files.items():
            if got[rel] != rec["sha256"]:
                raise CheckpointError(f"{path}: {rel} does not match its sha256 checksum (corrupted or changed)")
    return Checkpoint(path=path, step=int(manifest["step"]), meta=dict(manifest.get("meta") or {}))


def open_checkpoint(path: Path, verify: bool = True) -> Checkpoint:
    """A checkpoint dir, a ``checkpoints/`` dir or a run dir -> the (newest complete) checkpoint."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if (path / MANIFEST).exists() or _DONE.match(path.name) or _TMP.match(path.name):
        return check_checkpoint(path, verify)
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    scan = CheckpointStore(root).scan(verify)
    if scan.checkpoint is None:
        why = "".join(f"\n  skipped {s}" for s in scan.skipped)
        raise CheckpointError(f"{path}: no complete checkpoint in {root}{why}")
    return scan.checkpoint


class CheckpointStore:
    """The checkpoints of one run: begin/commit on the writing side, scan/resolve on resume."""

    def __init__(self, root: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: must keep at least 1 checkpoint")
        self.root, self.keep = Path(root), keep
        self._staging: dict[int, Path] = {}

    # -- writing -----------------------------------------------------------------------------
    def begin(self, step: int) -> Path:
        """Create and return a fresh staging directory for ``step``; every rank writes into it."""
        self.root.mkdir(parents=True, exist_ok=True)
        stage = self.root / f"{step_name(step)}.tmp-{uuid.uuid4().hex[:12]}"
        stage.mkdir()
        self._staging[step] = stage
        return stage

    def commit(self, step: int, meta: dict[str, str] | None = None) -> Path:
        """Make the staged checkpoint of ``step`` complete. Call once, after every rank has written.

        Checksums and fsyncs every file, writes manifest.json last, renames the staging dir to
        ``step_<n>`` and fsyncs the parent, then prunes old checkpoints and stale staging dirs.
        """
        stage = self._staging.pop(step, None) or self._find_stage(step)
        rels = _files(stage)
        if MANIFEST in rels:
            raise CheckpointError(f"{stage}: {MANIFEST} is reserved for the commit; a writer created one")
        t0 = time.monotonic()
        digests = _digests(stage, rels, f"checksumming {stage.name}", fsync=True)
        manifest: Manifest = {
            "format": FORMAT, "version": VERSION, "step": step, "time": time.time(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "meta": meta or {},
            "files": {r: {"size": (stage / r).stat().st_size, "sha256": digests[r]} for r in rels},
        }
        with open(stage / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for d in sorted({(stage / r).parent for r in rels} | {stage}, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(d)
        final = self.root / step_name(step)
        old = None
        if final.exists():  # re-saving a step (resumed from an older checkpoint): swap, then delete
            old = self.root / f"{step_name(step)}.tmp-old-{uuid.uuid4().hex[:12]}"
            os.rename(final, old)
        os.rename(stage, final)
        fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        total = sum(r["size"] for r in manifest["files"].values())
        log.info("checkpoint %s committed: %d files, %.1f MiB, %.1f s", final, len(rels), total / 2**20,
                 time.monotonic() - t0)
        self._prune(step)
        return final

    def _find_stage(self, step: int) -> Path:
        found = [p for p in self._tmp_dirs() if p[0] == step and "-old-" not in p[1].name and "-del-" not in p[1].name]
        if len(found) != 1:
            raise CheckpointError(f"{self.root}: commit({step}) needs exactly one staging dir from begin({step}), "
                                  f"found {[str(p) for _, p in found]}")
        return found[0][1]

    def complete(self) -> list[tuple[int, Path]]:
        """``step_<n>`` dirs with a parseable manifest, newest first (no file checks: cheap)."""
        out = []
        for step, path in self._done_dirs():
            try:
                read_manifest(path)
            except CheckpointError:
                continue
            out.append((step, path))
        return out

    def _prune(self, committed: int) -> None:
        """Keep the newest ``keep`` complete checkpoints (and always ``committed``); drop old staging dirs.

        Deletion renames first, so an interrupted delete leaves a ``.tmp-del-*`` dir (cleaned next
        time) rather than a ``step_<n>`` with missing files. Directories without a valid manifest
        are never deleted here; only staging dirs no newer than the newest complete checkpoint are.
        """
        complete = self.complete()
        keep = {s for s, _ in complete[: self.keep]} | {committed}
        doomed = [p for s, p in complete if s not in keep]
        newest = complete[0][0] if complete else committed
        live = set(self._staging.values())
        doomed += [p for s, p in self._tmp_dirs() if s <= newest and p not in live]
        for path in doomed:
            trash = path
            if _DONE.match(path.name):
                trash = self.root / f"{path.name}.tmp-del-{uuid.uuid4().hex[:12]}"
                os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            log.info("removed %s", path.name)

    # -- reading -----------------------------------------------------------------------------
    def _done_dirs(self) -> list[tuple[int, Path]]:
        return self._matching(_DONE)

    def _tmp_dirs(self) -> list[tuple[int, Path]]:
        return self._matching(_TMP)

    def _matching(self, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = ((pattern.match(p.name), p) for p in self.root.iterdir() if p.is_dir())
        return sorted(((int(m.group(1)), p) for m, p in found if m), key=lambda sp: (sp[0], sp[1].name), reverse=True)

    def scan(self, verify: bool = True) -> Scan:
        """The newest checkpoint that checks out; each newer one passed over is logged and listed."""
        skipped: list[str] = []
        found: Checkpoint | None = None
        for _, path in self._done_dirs():
            try:
                found = check_checkpoint(path, verify)
                break
            except CheckpointError as e:
                skipped.append(str(e))
        floor = found.step if found else -1
        skipped += [f"{p}: never committed (the run stopped while writing it)" for s, p in self._tmp_dirs()
                    if s > floor and "-old-" not in p.name and "-del-" not in p.name]
        for s in skipped:
            log.warning("checkpoint skipped: %s", s)
        if skipped and found:
            log.warning("using the previous complete checkpoint %s", found.path)
        return Scan(found, skipped)

    def latest(self, verify: bool = True) -> Checkpoint | None:
        return self.scan(verify).checkpoint

    def resolve(self, resume: str) -> Checkpoint | None:
        """``resume`` from the config: 'auto' (newest complete here, or None), 'never', or a path.

        A path may be a checkpoint dir, a run dir or a ``checkpoints/`` dir (its newest complete
        checkpoint), or a checkpoint name relative to this store. An unusable path raises
        CheckpointError (a ConfigError) naming the file and the problem.
        """
        if resume == "never":
            return None
        if resume == "auto":
            ckpt = self.latest()
            log.info("resume=auto: %s", f"resuming from {ckpt.path}" if ckpt else f"no checkpoint in {self.root}, starting fresh")
            return ckpt
        path = Path(resume).expanduser()
        if not path.exists() and not path.is_absolute() and (self.root / resume).exists():
            path = self.root / resume
        try:
            return open_checkpoint(path)
        except CheckpointError as e:
            raise CheckpointError(f"resume={resume!r}: {e}") from e
