"""The one error type for bad configuration, and how every entry point reports it."""

from __future__ import annotations

import sys

from rlbatch.launch.exit_codes import ExitCode


class ConfigError(ValueError):
    """A configuration that cannot run. Carries every problem found, one per line.

    Raised before any process starts or any job is submitted. ``problems`` lists each problem
    separately so callers (tests, the dry run) can inspect them; ``str()`` joins them.
    """

    def __init__(self, problems: str | list[str]) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        if not self.problems:
            raise ValueError("ConfigError needs at least one problem")
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the configuration:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(message)


def report_config_error(e: ConfigError) -> int:
    """Print every problem of ``e`` to stderr; returns exit code 2 (bad configuration)."""
    print("rlbatch: the configuration cannot run:", file=sys.stderr)
    for p in e.problems:
        print(f"  - {p}", file=sys.stderr)
    print("nothing was started.", file=sys.stderr)
    return int(ExitCode.BAD_CONFIG)
