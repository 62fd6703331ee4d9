"""Room for a checkpoint: how big one is, how much its filesystem has free, and the refusals.

A run that cannot write its next checkpoint should say so before it starts writing, naming the
path, the bytes needed and the bytes free, rather than fail half-way through the write:

- at launch (``check_room_at_start``, before anything is written or submitted): the size of the
  newest checkpoint already in the run directory, else an estimate from the model (a lower bound:
  fp32 weights plus AdamW's two moments, 12 bytes per parameter of each trainable role);
- before each save on the controller (``Checkpointer.save``): the size of the last checkpoint this
  run committed, else the same estimate.

Neither check can promise the write succeeds (other jobs share the filesystem); a write that
fails on a full disk anyway ends the run with ``DiskFull`` naming the same numbers
(``disk_full_error``), and the previous checkpoint stays the newest complete one. No torch import.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rlbatch.checkpoint.files import CHECKPOINTS, MANIFEST
from rlbatch.errors import ConfigError
from rlbatch.osinfo import mount_of, nearest_existing

if TYPE_CHECKING:
    from rlbatch.config.schema import RLBatchConfig
    from rlbatch.placement import Placement

BYTES_PER_TRAINED_PARAM = 12
"""fp32 master weight + AdamW exp_avg + exp_avg_sq, as every training engine saves them
(``rlbatch/engines/train_state.py``). DCP's per-tensor headers and the metadata file come on top."""
FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(RuntimeError):
    """A checkpoint does not fit (or did not fit) on its filesystem; the message has the numbers."""


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on ``path``'s filesystem (``f_bavail``)."""
    from rlbatch.runtime.faults import disk_full

    if disk_full():
        return 0
    st = os.statvfs(nearest_existing(path))
    return int(st.f_bavail * st.f_frsize)


def describe_fs(path: Path) -> str:
    """'tmpfs mounted at /scratch' for the filesystem that holds ``path`` (what is mounted and
    where, ``rlbatch.osinfo.mount_of``; the path itself where /proc cannot tell)."""
    p = nearest_existing(path)
    mount = mount_of(p)
    return f"{mount.source} mounted at {mount.point}" if mount else f"the filesystem that holds {p}"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB ({int(n)} bytes)"


def checkpoint_bytes(path: Path) -> int | None:
    """The size of a committed checkpoint (its manifest's files), None when unreadable."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        return int(sum(int(f["size"]) for f in manifest["files"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def newest_checkpoint_bytes(root: Path) -> int | None:
    """The size of the newest committed checkpoint under ``root`` (a ``checkpoints/`` dir)."""
    from rlbatch.checkpoint.store import CheckpointStore

    for _, path in CheckpointStore(root).complete():
        if (size := checkpoint_bytes(path)) is not None:
            return size
    return None


def estimate_bytes(cfg: RLBatchConfig, trainable_roles: list[str]) -> int:
    """A lower bound of one checkpoint's size: 12 bytes per parameter of each trainable role's
    model (the policy's; a critic's own ``critic_model.path`` where set). ``cfg``: the run's config,
    or the launcher's OmegaConf form of it (read by attribute alike)."""
    from collections.abc import Mapping

    from rlbatch.models.shape import ModelShape
    from rlbatch.models.spec import spec_from_config

    total = 0
    critic_path = getattr(getattr(cfg, "critic_model", None), "path", None)
    for role in trainable_roles:
        model: object = cfg.model
        if role == "critic" and critic_path:
            fields = dict(model.items()) if isinstance(model, Mapping) else dict(vars(model))
            model = fields | {"path": str(critic_path)}
        total += BYTES_PER_TRAINED_PARAM * ModelShape.of(spec_from_config(model)).params
    return total


def expected_bytes(cfg: RLBatchConfig, trainable_roles: list[str]) -> int:
    """``estimate_bytes``, or 0 (no check) when the model cannot be read here: validation reports
    a bad model itself, and a size check must not be what stops a run."""
    try:
        return estimate_bytes(cfg, trainable_roles)
    except (ConfigError, OSError, ValueError, KeyError, TypeError):
        return 0


def room_problem(directory: Path, need: int, what: str) -> str | None:
    """None when ``directory``'s filesystem has ``need`` bytes free, else the problem, in numbers."""
    free = free_bytes(directory)
    if free >= need:
        return None
    return (f"{what} needs about {mib(need)} in {directory}, and {describe_fs(directory)} has {mib(free)} free: "
            f"free space there or choose a run_dir on a filesystem with room")


def check_room_at_start(cfg: RLBatchConfig, placement: Placement, run_dir: Path) -> None:
    """ConfigError when ``run_dir``'s filesystem cannot hold one more checkpoint of this run
    (the newest one there, else the estimate): the run would fail at its first save."""
    from rlbatch.config.schema import TRAINABLE_ROLES

    trainable = [r for r in TRAINABLE_ROLES if r in placement.roles]
    if str(getattr(cfg, "program", "train")) != "train" or not trainable:
        return
    root = Path(run_dir) / CHECKPOINTS
    size = newest_checkpoint_bytes(root)
    need = size if size is not None else expected_bytes(cfg, trainable)
    what = "a checkpoint (the size of the newest one)" if size is not None else "a checkpoint (estimated from the model)"
    if problem := room_problem(root, need, what):
        raise ConfigError(f"run_dir: {problem}")


LOW_FREE = 1 << 20
"""A write that failed with less than this free on its filesystem ran out of space, whatever it
says: torch's zip writer reports a short write as 'unexpected pos', without the errno."""
FULL_TEXT = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def _chain(e: BaseException) -> list[BaseException]:
    """``e``, what it was raised from or during, and each rank's failure inside a DCP
    CheckpointException (its ``failures``: rank -> (exception, traceback))."""
    seen: list[BaseException] = []
    todo: list[object] = [e]
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or any(x is y for y in seen):
            continue
        seen.append(x)
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return seen


def is_disk_full(e: BaseException, path: Path | None = None) -> bool:
    """``e`` comes from a filesystem out of space or quota: an ENOSPC/EDQUOT anywhere in it, or
    (with ``path``) any failure while ``path``'s filesystem has less than LOW_FREE free."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in FULL:
            return True
        if any(t in str(x) for t in FULL_TEXT):
            return True
    if path is not None:
        try:
            return free_bytes(path) < LOW_FREE
        except OSError:
            return False
    return False


def failure_summary(e: BaseException) -> str:
    """One line per failure: DCP's CheckpointException carries every rank's traceback in its
    text, far too long for a status file or the console."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    parts = []
    for rank, f in sorted(failures.items()):
        x = f[0] if isinstance(f, tuple) else f
        parts.append(f"rank {rank} of the role: {type(x).__name__}: {str(x).strip().splitlines()[-1] if str(x).strip() else ''}")
    return "; ".join(parts)


def disk_full_error(path: Path, e: BaseException) -> DiskFull:
    """The error a checkpoint write that ran out of space ends with: the path and what is free."""
    return DiskFull(f"no space left writing the checkpoint {path}: {describe_fs(path)} has {mib(free_bytes(path))} "
                    f"free ({failure_summary(e)}). Committed checkpoints are intact; free space there and launch "
                    f"again to resume")
