"""What one sandboxed execution may use, and how strictly it is contained."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Isolation = Literal["auto", "namespaces", "process"]
"""``namespaces``: fresh user, mount, pid, network, IPC and UTS namespaces (util-linux ``unshare``,
needs unprivileged user namespaces or root), a read-only view of every mount, private tmpfs
``/tmp``, no capabilities; as root the code also runs as ``nobody``. ``process``: a fresh process
with the same resource limits, timeout, scrubbed environment and a private working directory,
but the network and the file system as the worker's user sees them. ``auto``: namespaces where the
node allows them, else process (the log says which)."""


@dataclass
class Limits:
    """Resource limits of one execution (``sandbox.limits.*`` in the config)."""

    timeout_s: float = 10.0
    """Wall-clock seconds for one execution (code and all its tests); then the whole process tree is killed."""
    test_timeout_s: float = 4.0
    """Seconds for the code's definitions and for each test (SIGALRM inside the child)."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS)."""
    file_mb: int = 16
    """Largest file the code may write, its output included (RLIMIT_FSIZE)."""
    tmp_mb: int = 64
    """Size of the private /tmp, /var/tmp and /dev/shm (namespaces isolation)."""
    processes: int = 32
    """Processes and threads (RLIMIT_NPROC; per user namespace, so per execution under namespaces)."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    output_kb: int = 16
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
