"""Per-rank logging: each rank's output goes to <run_dir>/logs/rank<r>.log.

Workers redirect file descriptors 1 and 2, so output from C++ (gloo, NCCL) lands in the log too.
The controller keeps the console (that is what the user watches) and mirrors it to its log.
A saved copy of the original stderr lets any rank put a fatal error on the console.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TextIO


class RankLog:
    def __init__(self, path: Path, rank: int, label: str, console: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.label = label
        self.console_err: TextIO = os.fdopen(os.dup(2), "w", buffering=1)
        fmt = logging.Formatter(f"%(asctime)s [{label}] %(levelname)s %(name)s: %(message)s")
        handlers: list[logging.Handler] = []
        if console:
            self.file: TextIO = open(path, "a", buffering=1)
            handlers.append(logging.StreamHandler(self.file))
            handlers.append(logging.StreamHandler(sys.stdout))
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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
