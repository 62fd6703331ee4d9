"""Checkpoint directories: atomic commit, manifest last, pruning, and falling back past damage."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

import rlbatch.checkpoint.store as store_mod
from rlbatch.checkpoint import CheckpointError, CheckpointStore, open_checkpoint
from rlbatch.errors import ConfigError

FILES = {"controller.json": b'{"step": 0}', "actor_train/.metadata": b"meta" * 10,
         "actor_train/__0_0.distcp": b"\x01" * 3000, "actor_train/__1_0.distcp": b"\x02" * 2000,
         "rng/rank0.pt": b"rng0", "rng/rank1.pt": b"rng1"}


def write(stage: Path, step: int) -> None:
    """What the ranks would write: every file's content depends on the step."""
    for rel, data in FILES.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(data + str(step).encode())


def save(store: CheckpointStore, step: int) -> Path:
    stage = store.begin(step)
    write(stage, step)
    return store.commit(step, {"step_seen": step})


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "checkpoints", keep=3)


def names(store: CheckpointStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir())


def test_commit_writes_a_complete_checkpoint_with_a_manifest_of_every_file(store: CheckpointStore) -> None:
    path = save(store, 12)
    assert path == store.root / "step_000012" and names(store) == ["step_000012"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["meta"] == {"step_seen": 12}
    assert set(manifest["files"]) == set(FILES)  # dotfiles (DCP's .metadata) included
    assert manifest["files"]["actor_train/__0_0.distcp"]["size"] == 3002
    ckpt = store.latest()
    assert ckpt is not None and (ckpt.path, ckpt.step, ckpt.meta) == (path, 12, {"step_seen": 12})


def test_manifest_is_fsynced_after_every_file_and_before_the_rename(store: CheckpointStore,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    fsync, rename = os.fsync, os.rename

    def record_fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync file " if os.path.isfile(path) else "fsync dir ") + path)
        fsync(fd)

    def record_rename(a: str | Path, b: str | Path) -> None:
        events.append(f"rename {Path(a).name} -> {Path(b).name}")
        rename(a, b)

    monkeypatch.setattr(store_mod.os, "fsync", record_fsync)
    monkeypatch.setattr(store_mod.os, "rename", record_rename)
    save(store, 1)
    files = [e for e in events if e.startswith("fsync file ")]
    assert len(files) == len(FILES) + 1 and files[-1].endswith("/manifest.json"), files
    rename = next(i for i, e in enumerate(events) if e.startswith("rename step_000001.tmp-"))
    assert events.index(files[-1]) < rename and events[rename].endswith("-> step_000001")
    assert events[rename + 1] == f"fsync dir {store.root}"  # the rename itself made durable


def test_an_interrupted_commit_leaves_the_previous_checkpoint_latest(store: CheckpointStore,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    save(store, 1)
    stage = store.begin(2)
    write(stage, 2)

    def crash(*_: object) -> None:
        raise OSError("node lost power")

    monkeypatch.setattr(store_mod.os, "rename", crash)
    with pytest.raises(OSError):
        store.commit(2)
    monkeypatch.undo()
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1
    save(store, 3)  # the next commit cleans the abandoned staging dir
    assert names(store) == ["step_000001", "step_000003"]


def test_pruning_keeps_the_newest_k_and_never_the_one_just_written(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", keep=2)
    for step in range(1, 6):
        save(store, step)
    assert names(store) == ["step_000004", "step_000005"]
    save(store, 3)  # resumed from an older checkpoint: step 3 is newest-written, not newest
    assert names(store) == ["step_000003", "step_000004", "step_000005"]
    save(store, 4)  # re-saving an existing step replaces it
    assert json.loads((store.root / "step_000004/controller.json").read_text().removesuffix("4")) == {"step": 0}
    assert names(store) == ["step_000004", "step_000005"]


def test_pruning_leaves_directories_without_a_manifest_alone(store: CheckpointStore) -> None:
    (store.root / "step_000001").mkdir(parents=True)
    (store.root / "notes").mkdir()
    for step in range(2, 7):
        save(store, step)
    assert names(store) == ["notes", "step_000001", "step_000004", "step_000005", "step_000006"]


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda p: (p / "actor_train/__1_0.distcp").write_bytes(b"\x03" * 2001), "actor_train/__1_0.distcp does not match its sha256"),
    (lambda p: os.truncate(p / "actor_train/__0_0.distcp", 1000), "actor_train/__0_0.distcp has 1000 bytes, the manifest says 3001"),
    (lambda p: (p / "rng/rank1.pt").unlink(), "rng/rank1.pt is missing"),
    (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
    (lambda p: (p / "manifest.json").write_text('{"format": "rlbatch-check'), "manifest.json is unreadable"),
])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(store: CheckpointStore, damage, reason: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    save(store, 1)
    newest = save(store, 2)
    damage(newest)
    with caplog.at_level(logging.WARNING):
        scan = store.scan()
    assert scan.checkpoint is not None and scan.checkpoint.step == 1
    assert len(scan.skipped) == 1 and str(newest) in scan.skipped[0] and reason in scan.skipped[0], scan.skipped
    assert reason in caplog.text and "using the previous complete checkpoint" in caplog.text
    with pytest.raises(CheckpointError, match=reason.replace("(", r"\(")):
        store.resolve(str(newest))


def test_without_verify_sizes_are_checked_but_not_checksums(store: CheckpointStore) -> None:
    save(store, 1)
    p = save(store, 2)
    (p / "rng/rank0.pt").write_bytes(b"RNG02")  # same size, other bytes
    assert store.latest(verify=False).step == 2  # type: ignore[union-attr]
    assert store.latest(verify=True).step == 1  # type: ignore[union-attr]
    os.truncate(p / "rng/rank0.pt", 1)
    assert store.latest(verify=False).step == 1  # type: ignore[union-attr]


def test_a_stale_staging_dir_is_reported_and_cleaned_once_superseded(store: CheckpointStore) -> None:
    save(store, 1)
    write(store.begin(2), 2)  # the run died while writing step 2
    later = store.begin(9)
    scan = CheckpointStore(store.root).scan()  # a restarted controller
    assert scan.checkpoint is not None and scan.checkpoint.step == 1
    assert [s for s in scan.skipped if "step_000002.tmp-" in s and "never committed" in s]
    restarted = CheckpointStore(store.root)
    save(restarted, 2)
    assert names(store) == ["step_000001", "step_000002", later.name]  # step 9's is newer: kept


def test_commit_by_a_store_that_did_not_begin_finds_the_one_staging_dir(store: CheckpointStore) -> None:
    write(store.begin(4), 4)
    assert CheckpointStore(store.root).commit(4).name == "step_000004"
    with pytest.raises(CheckpointError, match="exactly one staging dir"):
        CheckpointStore(store.root).commit(5)


def test_resolve(store: CheckpointStore, tmp_path: Path) -> None:
    assert store.resolve("auto") is None and store.resolve("never") is None
    save(store, 1)
    p2 = save(store, 2)
    assert store.resolve("never") is None
    assert store.resolve("auto").path == p2  # type: ignore[union-attr]
    assert store.resolve(str(store.root / "step_000001")).step == 1  # type: ignore[union-attr]
    assert store.resolve("step_000001").step == 1  # type: ignore[union-attr]  # relative to the store
    assert store.resolve(str(tmp_path)).step == 2  # type: ignore[union-attr]  # a run dir: its newest
    with pytest.raises(ConfigError, match=r"resume='/nowhere/step_000003': /nowhere/step_000003: no such"):
        store.resolve("/nowhere/step_000003")
    empty = tmp_path / "other_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        store.resolve(str(empty))
    (store.root / "step_000001" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="step_000001: no manifest.json"):
        open_checkpoint(store.root / "step_000001")


def test_hashing_is_chunked_and_logs_progress_for_big_checkpoints(store: CheckpointStore,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(store_mod, "CHUNK", 512)
    monkeypatch.setattr(store_mod, "PROGRESS_MIN_BYTES", 1000)
    monkeypatch.setattr(store_mod, "PROGRESS_EVERY_S", 0.0)
    save(store, 1)
    with caplog.at_level(logging.INFO, logger="rlbatch.checkpoint.store"):
        assert store.latest() is not None
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("verifying step_000001: ")]
    assert len(progress) > 5 and "100%" in progress[-2], progress


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep=0"):
        CheckpointStore(tmp_path, keep=0)
