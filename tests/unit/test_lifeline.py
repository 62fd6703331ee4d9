"""Lifelines name the rank that died first: real mpiexec (Hydra), tiny MPI programs holding them.

A rank that kills itself makes Hydra kill the others within milliseconds; the launcher must still
see the cause first, even when the dying rank has many threads and a forked child that outlives
it (a child holding the lifeline would make the dead rank look alive until the child ends, 3 s
after Hydra killed the others)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlbatch.checks.runnable import locate_mpiexec
from rlbatch.launch.local import FIRST_WINDOW_S, tee_and_watch
from rlbatch.runtime import lifeline
from rlbatch.runtime.lifeline import Lifelines

RANK = """
import os, signal, sys, threading, time
from mpi4py import MPI
from rlbatch.runtime.lifeline import hold
rank = MPI.COMM_WORLD.Get_rank()
time.sleep(float(sys.argv[2]) * rank)   # ranks connect one after another
hold(rank)
stop = threading.Event()
for _ in range(16):
    threading.Thread(target=stop.wait, daemon=True).start()
if rank == int(sys.argv[1]) and os.fork() == 0:  # a child that outlives its parent by 3 s, holding none of Hydra's descriptors
    os.closerange(0, 100)  # below the lifeline (lifeline.LOW_FD)
    time.sleep(3)
    os._exit(0)
if float(sys.argv[2]) == 0:
    MPI.COMM_WORLD.Barrier()            # every rank holds its lifeline
if rank == int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(30)
"""


def _first(tmp_path: Path, killed: int, stagger_s: float, world: int = 4) -> list[int]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with Lifelines(world) as lines:
        env = dict(os.environ) | {lifeline.ENV: lines.address,
                                  "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.Popen([locate_mpiexec(""), "-n", str(world), sys.executable, str(script), str(killed),
                                 str(stagger_s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        try:
            first = tee_and_watch(proc, lines)
        finally:
            proc.kill()
            proc.wait()
    return first


@pytest.mark.timeout(120)
@pytest.mark.parametrize("killed", [2, 0])
def test_the_rank_that_killed_itself_is_seen_ending_first(tmp_path: Path, killed: int) -> None:
    first = _first(tmp_path, killed, 0.0)
    assert first and first[0] == killed, first
    assert sorted(first) == sorted(set(first)), first


@pytest.mark.timeout(120)
def test_no_first_rank_when_one_ended_before_every_rank_held_its_lifeline(tmp_path: Path) -> None:
    # rank 0 dies at once; rank 3 would connect 3 s later: rank 0 is the cause here, but in a run
    # the one that never connected could be, so the launcher names none (the status files speak).
    assert _first(tmp_path, 0, 1.0) == []


def test_hold_is_a_no_op_outside_a_local_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lifeline.ENV, raising=False)
    lifeline.hold(0)
    assert lifeline._held is None


def test_a_window_keeps_the_ranks_that_ended_together() -> None:
    lines = Lifelines(3)
    try:
        lines.all_held_at_first_end = True
        lines.ended = [(10.0, 1), (10.0 + FIRST_WINDOW_S / 2, 0), (10.0 + 2 * FIRST_WINDOW_S, 2)]
        assert lines.first(FIRST_WINDOW_S) == [1, 0]
    finally:
        lines.close()


def test_a_connection_from_another_user_is_not_a_lifeline(monkeypatch: pytest.MonkeyPatch) -> None:
    import selectors
    import socket

    def rank_0_lives_and_ends(lines: Lifelines, sel: selectors.BaseSelector) -> None:
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.connect("\0" + lines.address)
        peer.sendall(b"0\n")
        lines.drain(sel, quiet_s=0.1)
        peer.close()
        lines.drain(sel, quiet_s=0.1)

    with Lifelines(1) as lines, selectors.DefaultSelector() as sel:
        lines.register(sel)
        uid = os.getuid()
        monkeypatch.setattr(lifeline.os, "getuid", lambda: uid + 1)  # the launcher: someone else
        rank_0_lives_and_ends(lines, sel)
        assert lines.ended == [] and not lines._conns
        monkeypatch.undo()
        rank_0_lives_and_ends(lines, sel)
        assert [rank for _, rank in lines.ended] == [0]
