"""What one sandboxed execution may use, and how strictly it is contained."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from rlbatch.config.bounds import TIMEOUT_MAX_S, bounded

Isolation = Literal["auto", "namespaces", "process"]
"""``namespaces``: fresh user, mount, pid, network, IPC and UTS namespaces (util-linux ``unshare``,
needs unprivileged user namespaces or root), a read-only view of every mount, private tmpfs
``/tmp``, no capabilities; as root the code also runs as a uid of its own (one per execution, no
account's). ``process``: a fresh process with the same resource limits, timeout, scrubbed
environment and a private working directory, as a uid of its own when the worker is root, but the
network and the file system as that user sees them (the log says so). Both: a seccomp filter keeps
the code from signalling, tracing or re-limiting any other process (docs/sandbox.md). ``auto``:
namespaces where the node allows them, else process (the log says which)."""


@dataclass
class Limits:
    """Resource limits of one execution (``sandbox.limits.*`` in the config)."""

    timeout_s: float = bounded(10.0, gt=0, le=TIMEOUT_MAX_S, why="Python's waits overflow beyond it")
    """Wall-clock seconds for one execution (code and all its tests); then the whole process tree is killed."""
    test_timeout_s: float = bounded(4.0, gt=0, le=TIMEOUT_MAX_S, why="the interval timer overflows beyond it")
    """Seconds for the code's definitions and for each test (SIGALRM inside the child)."""
    cpu_s: int = bounded(10, ge=1)
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = bounded(512, ge=64, le=2**43 - 1, why="the Python interpreter alone needs ~40 MB of "
                                                           "address space; RLIMIT_AS takes bytes in 63 bits")
    """Address space (RLIMIT_AS)."""
    file_mb: int = bounded(16, ge=1, le=2**43 - 1, why="RLIMIT_FSIZE takes bytes in 63 bits")
    """Largest file the code may write, its output included (RLIMIT_FSIZE)."""
    tmp_mb: int = bounded(64, ge=1)
    """Size of the private /tmp, /var/tmp and /dev/shm (namespaces isolation)."""
    processes: int = bounded(32, ge=1)
    """Processes and threads the code may have at once, itself included (RLIMIT_NPROC, which the
    kernel counts per uid, and from Linux 5.14 per user namespace): the execution's own under a
    root worker (each execution a uid of its own) and under namespaces (Linux >= 5.14). Otherwise
    the executions run as the worker's user: each may start this many more than that user has
    running when it starts, and the executions running at the same time share what is left
    (docs/sandbox.md)."""
    open_files: int = bounded(64, ge=8, why="the interpreter's own")
    """Open file descriptors (RLIMIT_NOFILE)."""
    output_kb: int = bounded(16, ge=1, le=2**53 - 1, why="read as bytes in 63 bits")
    """stdout and stderr kept per execution (the rest is dropped)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self, field: str = "sandbox") -> None:
        """Refuse limits that cannot work, naming the field and the value."""
        positive = {"timeout_s": self.timeout_s, "test_timeout_s": self.test_timeout_s, "cpu_s": self.cpu_s,
                    "memory_mb": self.memory_mb, "file_mb": self.file_mb, "tmp_mb": self.tmp_mb,
                    "processes": self.processes, "open_files": self.open_files, "output_kb": self.output_kb}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{field}.{name} must be > 0, got {value}")
        if self.memory_mb < 64:
            raise ValueError(f"{field}.memory_mb: the Python interpreter alone needs ~40 MB of address space; "
                             f"got {self.memory_mb}, use >= 64")
        if self.open_files < 8:
            raise ValueError(f"{field}.open_files must be >= 8 (the interpreter's own), got {self.open_files}")
