"""Per-rank logging: each rank's output goes to <run_dir>/logs/rank<r>.log.

Workers redirect file descriptors 1 and 2, so output from C++ (gloo, NCCL) lands in the log too.
The controller keeps the console (that is what the user watches) and mirrors it to its log.
A saved copy of the original stderr lets any rank put a fatal error on the console.

A full disk must not take the rank down with it, nor flood the console: a log file that cannot
be opened leaves the rank's output on the console, and the first failed write to the controller's
log file is reported once, after which its lines go to the console only.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TextIO


class _FileHandler(logging.StreamHandler[TextIO]):
    """A log file's handler that, when a write fails (ENOSPC), says so once on the console and
    then drops its records, instead of logging's traceback on stderr for every record."""

    def __init__(self, stream: TextIO, path: Path, console_err: TextIO) -> None:
        super().__init__(stream)
        self.path, self.console_err, self.failed = path, console_err, False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True
        err = sys.exc_info()[1]
        try:
            self.console_err.write(f"rlbatch: cannot write the log {self.path} ({err}); "
                                   f"its lines go to the console only from now on\n")
            self.console_err.flush()
        except OSError:
            pass


class RankLog:
    def __init__(self, path: Path, rank: int, label: str, console: bool) -> None:
        self.label = label
        self.console_err: TextIO = os.fdopen(os.dup(2), "w", buffering=1)
        fmt = logging.Formatter(f"%(asctime)s [{label}] %(levelname)s %(name)s: %(message)s")
        handlers: list[logging.Handler] = []
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:  # a full disk, a quota: the rank still runs, its output on the console
            self.fatal(f"cannot open the log {path} ({e}); this rank's output goes to the console")
            console, fd = True, -1
        if console:
            self.file: TextIO = os.fdopen(fd, "a", buffering=1) if fd >= 0 else sys.stdout
            if fd >= 0:
                handlers.append(_FileHandler(self.file, path, self.console_err))
            handlers.append(logging.StreamHandler(sys.stdout))
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            self.file = sys.stdout
            handlers.append(logging.StreamHandler(sys.stderr))
        for h in handlers:
            h.setFormatter(fmt)
        logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)

    def fatal(self, message: str) -> None:
        """Put a fatal error on the console, whatever stdout/stderr point to."""
        self.console_err.write(f"[{self.label}] {message}\n")
        self.console_err.flush()
