"""What the operating system says about paths and processes, read from /proc: shared by the
config checks (is a run directory writable, on which filesystem), the checkpoint space checks
and the run-directory lock. A leaf: it imports nothing of rlbatch (the config's type only for the
type checker)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlbatch.config.schema import ClusterConfig


@dataclass(frozen=True)
class Mount:
    point: Path
    """Where it is mounted."""
    fstype: str
    """'ext4', 'tmpfs', 'nfs4', 'proc', ..."""
    source: str
    """What is mounted: a device ('/dev/vda1'), a server's export, or the filesystem's name."""


def nearest_existing(path: Path) -> Path:
    """``path`` (made absolute, symbolic links followed as mkdir follows them) or its nearest
    ancestor that exists: where a directory to be created would go."""
    path = Path(path).expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes there."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: Path) -> Mount | None:
    """The mount that holds ``path`` (absolute, existing), from /proc/self/mountinfo: the deepest
    mount point above it, the later of equal ones (it hides the earlier); None where that cannot
    be read."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    best: Mount | None = None
    for line in lines:
        mount, sep, rest = line.partition(" - ")
        fields, tail = mount.split(), rest.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        point = Path(_unescape(fields[4]))
        if (point == path or point in path.parents) and (best is None or len(point.parts) >= len(best.point.parts)):
            best = Mount(point, tail[0], _unescape(tail[1]) if len(tail) > 1 else tail[0])
    return best


def process_cmdline(pid: int) -> str | None:
    """Process ``pid``'s command line, its arguments joined by spaces; None when it is gone or
    cannot be read."""
    try:
        return Path(f"/proc/{int(pid)}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return None


def on_cpu(cluster: ClusterConfig) -> bool | None:
    """Whether the GPU roles' ranks run on CPUs: ``cluster.device``, or for 'auto' on cluster=local
    whether this machine has NVIDIA devices; None when unknown (a Slurm job's nodes with device=auto)."""
    if cluster.device in ("cpu", "cuda"):
        return cluster.device == "cpu"
    if cluster.name == "local":
        return not any(Path("/dev").glob("nvidia[0-9]*"))
    return None
