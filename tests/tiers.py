"""The suite's two tiers, its Slurm tests' cluster and its per-test time limits (a pytest plugin,
loaded by tests/conftest.py).

    make test        pytest --tier=fast   every capability's wiring: unit tests and one fast
                                          end-to-end test per capability (CI runs this)
    make test-all    pytest --tier=all    adds the tests marked ``full``: the learning curves, the
                                          engine x placement matrices, the long Slurm runs, the
                                          benchmarks run as tests

A plain ``pytest`` is ``--tier=all``. The Slurm tests (marker ``slurm``) run on the two-node dev
cluster (slurm/dev-cluster.sh), which tests/slurm/conftest.py starts when one of them is selected;
starting it needs root. Without root, and with no cluster up, they do not run, and the summary at
the end says so and why (never silently).

A test without a ``timeout`` marker gets its directory's limit (``LIMITS``): sized from each
tier's slowest tests on a loaded 2-core machine, so that a hang fails by the test's name within
minutes instead of holding the whole run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

LIMITS = {"unit": 120, "dist": 300, "slurm": 300, "gpu": 600}
"""tests/<dir> -> seconds a test there may take unless its own ``timeout`` marker says otherwise."""

_SKIPPED = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=("fast", "all"), default="all",
                     help="fast: the tier make test runs (deselects the tests marked 'full'); all: every test "
                          "(make test-all)")


def slurm_unavailable() -> str | None:
    """Why the Slurm tests cannot run here, or None: they can (the dev cluster is up, or this
    process may start it)."""
    if os.geteuid() == 0:
        return None  # tests/slurm/conftest.py starts the cluster (and fails loudly if it cannot)
    if shutil.which("sinfo"):
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        if out.returncode == 0 and all(states.get(n, "").rstrip("*") in ("idle", "mix", "alloc") for n in ("n1", "n2")):
            return None
    return ("the two-node dev Slurm cluster is not running, and starting it needs root (slurm/dev-cluster.sh "
            "installs slurm-wlm and munge and starts slurmd): run `sudo bash slurm/dev-cluster.sh start`, then the "
            "tests again")


@pytest.hookimpl(trylast=True)  # after -m and -k: only what is still selected counts
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dropped: list[pytest.Item] = []
    if config.getoption("--tier") == "fast":
        dropped += [item for item in items if item.get_closest_marker("full")]
    slurm = [item for item in items if item.get_closest_marker("slurm") and item not in dropped]
    if slurm and (why := slurm_unavailable()):
        dropped += slurm
        config.stash[_SKIPPED] = f"{len(slurm)} Slurm test(s) did not run: {why}"
    if dropped:
        gone = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in gone]
        config.hook.pytest_deselected(items=dropped)
    for item in items:
        if item.get_closest_marker("timeout") is None and (limit := limit_for(Path(str(item.path)))):
            item.add_marker(pytest.mark.timeout(limit))


def limit_for(path: Path) -> int | None:
    """The time limit of a test in ``path`` without a ``timeout`` marker: its tests/<dir>'s."""
    return LIMITS.get(path.relative_to(TESTS).parts[0]) if TESTS in path.parents else None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if why := config.stash.get(_SKIPPED, None):
        terminalreporter.section("not run", sep="=", bold=True, yellow=True)
        terminalreporter.line(f"rlbatch: {why}", yellow=True, bold=True)
