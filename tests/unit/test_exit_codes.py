"""The launcher's exit codes: how a run's end maps to them, the README's table of them, and the
launcher's Ctrl-C handling on real processes (a stand-in for mpiexec, no MPI)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbatch.errors import ExitCode
from rlbatch.launch import interrupt
from rlbatch.launch.exit_codes import run_exit_code
from rlbatch.launch.interrupt import StopRequests
from rlbatch.runtime.rundir import RunDir
from tests.conftest import REPO_ROOT

EXITED = {"state": "exited", "code": 0}


@pytest.mark.parametrize(("ended_cleanly", "status", "stopped_now", "code"), [
    (True, EXITED, False, ExitCode.FINISHED),
    (True, EXITED | {"stopped": "preempted", "reason": "signal SIGUSR2"}, False, ExitCode.PREEMPTED),
    (True, EXITED | {"stopped": "interrupted", "reason": "signal SIGINT"}, False, ExitCode.INTERRUPTED),
    # The run reached its end before a second Ctrl-C took effect: it finished.
    (True, EXITED, True, ExitCode.FINISHED),
    (False, {"state": "terminated", "signal": "SIGTERM"}, True, ExitCode.STOPPED_NOW),
    (False, {"state": "failed", "error": "RuntimeError: x"}, False, ExitCode.FAILED),
    (False, None, False, ExitCode.FAILED),
])
def test_how_a_run_ended_maps_to_one_exit_code(ended_cleanly: bool, status: dict | None, stopped_now: bool,
                                               code: ExitCode) -> None:
    assert run_exit_code(ended_cleanly, status, stopped_now) == code


def test_the_codes_are_distinct_and_the_readme_table_lists_each_one() -> None:
    assert len({int(c) for c in ExitCode}) == len(ExitCode)
    readme = (REPO_ROOT / "README.md").read_text()
    table = dict(re.findall(r"^\| `(\d+)` \| (\w+) \|", readme, flags=re.M))
    assert {int(k): v for k, v in table.items()} == {int(c): c.name.lower() for c in ExitCode}


FAKE_MPIEXEC = r"""
import json, os, signal, subprocess, sys, time
# Like Hydra: each rank in a session of its own. The rank records SIGINT; with "stuck" it also
# ignores SIGTERM and never ends by itself.
if sys.argv[1] == "rank":
    stuck = sys.argv[3] == "stuck"
    got = []
    signal.signal(signal.SIGINT, lambda s, f: got.append(s))
    if stuck:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    status = sys.argv[2]
    with open(status + ".tmp", "w") as f:
        json.dump({"rank": 0, "state": "running", "pid": os.getpid()}, f)
    os.replace(status + ".tmp", status)
    while stuck or not got:
        time.sleep(0.01)
    with open(status + ".tmp", "w") as f:
        json.dump({"rank": 0, "state": "exited", "pid": os.getpid(), "code": 0, "stopped": "interrupted"}, f)
    os.replace(status + ".tmp", status)
    sys.exit(0)
rank = subprocess.Popen([sys.executable, __file__, "rank", *sys.argv[1:]], start_new_session=True)
sys.exit(rank.wait())
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def fake_run(tmp_path: Path, stuck: bool) -> tuple[RunDir, list[str]]:
    run = RunDir(tmp_path)
    run.logs.mkdir()
    script = tmp_path / "fake_mpiexec.py"
    script.write_text(FAKE_MPIEXEC)
    return run, [sys.executable, str(script), str(run.rank_status(0)), "stuck" if stuck else "done"]


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # the handler runs in this (the main) thread right after
    time.sleep(0.05)


def test_first_ctrl_c_asks_the_controller_rank_to_stop_and_no_stale_pid(tmp_path: Path) -> None:
    """Ctrl-C before the controller rank runs: the request waits for it, and goes to the rank
    mpiexec started, not to the pid a previous launch's status file names."""
    run, cmd = fake_run(tmp_path, stuck=False)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # SIG_IGN in a background job
    bystander = subprocess.Popen(["sleep", "60"])  # SIGINT would end it
    try:
        (tmp_path / "logs" / "rank0.status").write_text(f'{{"rank": 0, "state": "running", "pid": {bystander.pid}}}')
        with StopRequests(run, 0, "USR2") as stops:
            ctrl_c()  # before mpiexec even starts
            proc = stops.start(cmd, dict(os.environ))
            assert proc.wait(timeout=30) == 0, "the rank ends once it has the stop request"
        assert stops.asked == 1 and not stops.stopped_now
        assert run.read_status(0)["stopped"] == "interrupted"
        assert bystander.poll() is None, "the stale pid got no signal"
    finally:
        bystander.kill()
        bystander.wait()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before, "the handlers are restored"


def test_second_ctrl_c_ends_every_process_even_one_that_ignores_sigterm(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interrupt, "STOP_GRACE_S", 0.5)
    run, cmd = fake_run(tmp_path, stuck=True)
    with StopRequests(run, 0, "USR2") as stops:
        proc = stops.start(cmd, dict(os.environ))
        deadline = time.monotonic() + 30
        while (st := run.read_status(0)) is None or st.get("state") != "running":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ctrl_c()
        ctrl_c()
        started = time.monotonic()
        proc.wait(timeout=30)
    rank = int(st["pid"])
    try:
        assert stops.stopped_now
        assert not alive(rank), "the rank outlived the launcher"
        assert time.monotonic() - started < 10
    finally:
        if alive(rank):
            os.kill(rank, signal.SIGKILL)
