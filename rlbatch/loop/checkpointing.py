"""The controller's side of checkpoints: resume before the loop, save at step boundaries.

Every rank writes its own shards (DCP, staged through CPU) into a staging directory; when all
have answered, the controller adds its own state and commits the checkpoint atomically (see
rlbatch.checkpoint.store). Inference weights are not saved: after resume they are synced from
actor_train like after any step. Other controller-side state (the generations made ahead of
training) joins as a *part*: ``save(stage) -> dict`` writes its files and returns its share of
controller.json, ``load(ckpt, state)`` restores it.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Protocol

from rlbatch.checkpoint.files import ControllerState, read_controller, write_controller
from rlbatch.checkpoint.space import (
    DiskFull,
    checkpoint_bytes,
    describe_fs,
    disk_full_error,
    expected_bytes,
    free_bytes,
    is_disk_full,
    mib,
    newest_checkpoint_bytes,
    room_problem,
)
from rlbatch.checkpoint.store import CheckpointError, CheckpointStore
from rlbatch.config.schema import TRAINABLE_ROLES, RLBatchConfig
from rlbatch.data.synthetic import PromptStream
from rlbatch.loop.controller import Pipeline
from rlbatch.runtime.faults import maybe_fault
from rlbatch.runtime.rundir import RunDir

log = logging.getLogger(__name__)


class Part(Protocol):
    def save(self, stage: Path) -> ControllerState: ...

    def load(self, ckpt: Path, state: ControllerState) -> None: ...


class Checkpointer:
    def __init__(self, pipe: Pipeline, run: RunDir, cfg: RLBatchConfig, data: PromptStream, data_fingerprint: str,
                 parts: tuple[Part, ...] = ()) -> None:
        self.pipe, self.run, self.cfg, self.parts = pipe, run, cfg, parts
        self.data, self.fingerprint = data, data_fingerprint
        self.store = CheckpointStore(run.path / "checkpoints", keep=int(cfg.keep_checkpoints))
        self.last_save_s = 0.0
        self.roles = tuple(r for r in TRAINABLE_ROLES if r in pipe.p.roles)
        size = newest_checkpoint_bytes(self.store.root)
        self.expected_bytes = size if size is not None else expected_bytes(cfg, list(self.roles))
        """What the next checkpoint needs: the last one's size, else the model's estimate (a lower bound)."""
        free = free_bytes(self.store.root)
        room = free // max(self.expected_bytes, 1)
        (log.warning if room < 2 else log.info)(
            "checkpoints need about %s each; %s has %s free (room for %d)", mib(self.expected_bytes),
            describe_fs(self.store.root), mib(free), room)

    def _all_ranks(self, op: str, path: str) -> None:
        self.pipe.run("checkpoint", self.roles, {r: {"op": op, "path": path} for r in self.pipe.workers()})

    def resume(self) -> int:
        """Load the checkpoint ``cfg.resume`` names, if any; returns the first step to run."""
        ckpt = self.store.resolve(str(self.cfg.resume))
        if ckpt is None:
            return 0
        state = read_controller(ckpt.path)
        if state.get("data_fingerprint") != self.fingerprint:
            raise CheckpointError(
                f"{ckpt.path}: the dataset changed since this checkpoint was written (fingerprint "
                f"{state.get('data_fingerprint')} then, {self.fingerprint} now); resuming would not continue "
                f"the same data stream. Restore the dataset, or start a new run_dir (or resume=never)."
            )
        print(f"resuming from {ckpt.path} (step {ckpt.step})", flush=True)
        self._all_ranks("load", str(ckpt.path))
        self.data.load_state_dict(state["data"])
        for part in self.parts:
            part.load(ckpt.path, state)
        return int(state["step"]) + 1

    def save(self, step: int, reason: str) -> None:
        """Write and commit the checkpoint of ``step``. Raises DiskFull before writing anything
        when its filesystem has less free than the last checkpoint's size, and when a write runs
        out of space (the partial checkpoint is removed; the previous one stays the newest)."""
        start = time.perf_counter()
        if problem := room_problem(self.store.root, self.expected_bytes, f"the checkpoint of step {step}"):
            raise DiskFull(f"{problem}. Nothing of it was written; committed checkpoints are intact")
        stage = self.store.begin(step)
        maybe_fault("checkpoint_write", self.pipe.world.rank)  # the disk filling up after the check
        try:
            self._all_ranks("save", str(stage))
            state: ControllerState = {}
            for part in self.parts:
                state |= part.save(stage)
            write_controller(stage, state | {"step": step, "data": self.data.state_dict(),
                                             "data_fingerprint": self.fingerprint, "reason": reason}, self.run.config)
            path = self.store.commit(step, {"run_dir": str(self.run.path), "reason": reason})
        except BaseException as e:
            if not (isinstance(e, DiskFull) or is_disk_full(e, stage) or DiskFull.__name__ in str(e)):
                raise
            shutil.rmtree(stage, ignore_errors=True)  # its space, for the logs; every rank has answered
            if isinstance(e, DiskFull):
                raise
            raise disk_full_error(stage, e) from e
        self.expected_bytes = checkpoint_bytes(path) or self.expected_bytes
        self.last_save_s = time.perf_counter() - start
        log.info("checkpoint %s (%s) in %.1fs", path, reason, self.last_save_s)
