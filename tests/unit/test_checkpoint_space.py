"""A full disk: refused before a checkpoint is written, named when a write runs out anyway, and the
error path that reports it cannot fail on it."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import rlbatch.checkpoint.engine_state as engine_state
import rlbatch.checkpoint.space as space
import rlbatch.loop.checkpointing as checkpointing
from rlbatch.checkpoint.space import DiskFull
from rlbatch.config.compose import compose
from rlbatch.errors import ConfigError
from rlbatch.runtime.rundir import RunDir

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
TINY_PARAMS = 124_608
"""Parameters of the default model (64 wide, 2 layers, the character vocabulary)."""


def free(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(space, "free_bytes", lambda path: n)
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: n)


def test_the_estimate_is_weights_and_adam_moments_in_fp32() -> None:
    cfg = compose([])
    assert space.estimate_bytes(cfg, ["actor_train"]) == 12 * TINY_PARAMS
    assert space.estimate_bytes(cfg, ["actor_train", "critic"]) == 2 * 12 * TINY_PARAMS


class FakePipe:
    """The controller's pipeline as Checkpointer sees it: it records the phases it is asked to run."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.p = SimpleNamespace(roles={"actor_train": None, "actor_infer": None})
        self.world = SimpleNamespace(rank=3)
        self.calls: list[Any] = []
        self.fail = fail

    def workers(self) -> list[int]:
        return [0, 1]

    def run(self, *args: Any) -> dict[int, Any]:
        self.calls.append(args)
        if self.fail is not None:
            raise self.fail
        return {}


def checkpointer(tmp_path: Path, pipe: FakePipe) -> checkpointing.Checkpointer:
    cfg = compose([f"run_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text("run: config\n")
    data = SimpleNamespace(state_dict=lambda: {"position": 0})
    return checkpointing.Checkpointer(pipe, RunDir(tmp_path), cfg, data, "fp")  # type: ignore[arg-type]


def test_a_save_that_cannot_fit_is_refused_before_anything_is_written(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    free(monkeypatch, 1 << 20)
    pipe = FakePipe()
    ckpt = checkpointer(tmp_path, pipe)
    with pytest.raises(DiskFull) as e:
        ckpt.save(4, "save_every")
    message = str(e.value)
    assert f"the checkpoint of step 4 needs about 1.4 MiB ({12 * TINY_PARAMS} bytes) in {tmp_path / 'checkpoints'}" in message
    assert "has 1.0 MiB (1048576 bytes) free" in message and "mounted at" in message
    assert pipe.calls == []  # no rank was asked to write
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_write_that_runs_out_removes_its_partial_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free(monkeypatch, 1 << 30)
    failure = RuntimeError("'phase' failed on rank 0:\nrlbatch.checkpoint.space.DiskFull: no space left writing ...")
    ckpt = checkpointer(tmp_path, FakePipe(failure))
    with pytest.raises(DiskFull, match="no space left writing the checkpoint .*step_000002.tmp-"):
        ckpt.save(2, "save_every")
    assert list((tmp_path / "checkpoints").iterdir()) == []


class Engine:
    def checkpoint_state(self) -> object:
        return object()


def dcp_failure(exc: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("write", {1: (exc, [])})


@pytest.mark.parametrize(("failure", "free_now", "expected"), [
    (ENOSPC, 1 << 30, DiskFull),  # ENOSPC on another rank of the role, inside DCP's exception
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), 0, DiskFull),  # a short write
    (ValueError("something else"), 1 << 30, RuntimeError),
])
def test_a_failed_rank_write_is_an_exception_the_command_server_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException, free_now: int, expected: type) -> None:
    # DCP raises CheckpointException, a BaseException: the command server answers the controller
    # only for an Exception, and the controller would wait out cluster.timeout_s.
    def save_state(path: Path, state: object) -> dict[str, float]:
        raise dcp_failure(failure)

    monkeypatch.setattr(engine_state, "save_state", save_state)
    free(monkeypatch, free_now)
    with pytest.raises(expected) as e:
        engine_state.save_rank(tmp_path, {"actor_train": Engine()}, 0)
    assert isinstance(e.value, Exception)
    if expected is DiskFull:
        assert f"no space left writing the checkpoint {tmp_path}" in str(e.value)
        assert f"MiB ({free_now} bytes) free" in str(e.value)
    assert "Traceback" not in str(e.value)  # one line per rank, not DCP's tracebacks


def test_a_status_write_on_a_full_disk_rewrites_in_place_and_never_raises(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunDir(tmp_path)
    run.logs.mkdir()
    assert run.write_status(0, "running", roles=["actor_train"])

    def full(self: Path, *args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full)
    assert run.write_status(0, "failed", error="DiskFull: " + "x" * 10_000)  # its block is already there
    st = run.read_status(0)
    assert st is not None and st["state"] == "failed" and st["error"].startswith("DiskFull: x")
    assert (tmp_path / "logs" / "rank0.status").stat().st_size <= 4096
    assert not run.write_status(1, "failed", error="no file to rewrite")  # nothing to rewrite: no record, no raise
    assert not (tmp_path / "logs" / "rank1.status.tmp").exists()


def test_a_launch_onto_a_filesystem_without_room_is_refused_before_it_writes(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbatch.checks.validate import check
    from rlbatch.launch.rundir import prepare_run_dir

    free(monkeypatch, 100_000)
    cfg = compose([f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"run_dir: a checkpoint \(estimated from the model\) needs about 1.4 MiB "
                                          r"\(1495296 bytes\) in .*checkpoints, and .* has 0.1 MiB \(100000 bytes\) free"):
        prepare_run_dir(cfg, check(cfg))
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_rank_log_that_cannot_be_opened_leaves_the_rank_on_the_console(tmp_path: Path,
                                                                        capfd: pytest.CaptureFixture[str]) -> None:
    from rlbatch.runtime.logs import RankLog

    (tmp_path / "logs").write_text("a file where the log directory should be")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        RankLog(tmp_path / "logs" / "rank0.log", 0, "rank 0", console=False)
    finally:
        root.handlers[:], root.level = handlers, level
    assert "cannot open the log" in capfd.readouterr().err


def test_the_disk_full_fault_fills_the_disk_for_one_process(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    code = ("import os, sys; from pathlib import Path; from rlbatch.runtime import faults\n"
            "p = Path(sys.argv[1]); p.write_text('0123456789'); faults.fill_disk()\n"
            "from rlbatch.checkpoint.space import free_bytes; print(free_bytes(p))\n"
            "fd = os.open(p, os.O_WRONLY); os.write(fd, b'ab'); os.close(fd)\n"
            "try:\n    (p.parent / 'new').write_text('x')\nexcept OSError as e:\n    print(e.errno)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f")], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=60)
    assert out.stdout.split() == ["0", str(errno.ENOSPC)], out.stderr
    assert (tmp_path / "f").read_text() == "ab23456789" and not (tmp_path / "new").exists()


def test_a_failed_rank_read_is_an_exception_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbatch.checkpoint.store import CheckpointError

    (tmp_path / "actor_train").mkdir()
    (tmp_path / "actor_train" / ".metadata").write_bytes(b"")

    def load_state(path: Path, template: object) -> object:
        raise dcp_failure(ValueError("size mismatch for model.embed_tokens.weight"))

    monkeypatch.setattr(engine_state, "load_state", load_state)
    with pytest.raises(CheckpointError, match="reading actor_train failed: rank 1 of the role: ValueError: size mismatch"):
        engine_state.load_rank(tmp_path, {"actor_train": Engine()}, 0)
