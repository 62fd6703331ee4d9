"""Name the ranks that brought a run down, from the status files every rank keeps.

    python -m rlbatch.runtime.postmortem <run_dir>   # run by the sbatch script after srun

When one rank dies, the others fail too: their collectives lose a peer, the controller stops
hearing from them, the launcher tears them down. Those are consequences. The report names the
cause first: a run directory missing on a node (its ranks could not even start), else a rank that
failed with its own error, else the ranks that hung (the controller's wait for a phase expired
naming them, and they neither answered nor failed: the launcher stopped them with the rest), else
the rank the launcher saw vanish first (killed by a signal or the OOM killer), else the ranks whose
collectives or waits failed.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

from rlbatch.placement import Placement
from rlbatch.runtime.env import SchedulerEnv, expand_hostlist, read_env
from rlbatch.runtime.rundir import RunDir

SECONDARY = ("CollectiveError", "ControlTimeout", "DistBackendError", "DistNetworkError")
"""Errors a rank gets because some other rank failed."""
_WAITED = re.compile(r"timed out after (?P<secs>[0-9.]+)s waiting for (?P<what>.+?): no reply from ")
"""A command's timeout, worded by ``rlbatch.runtime.control.Call.wait`` (``NO_REPLY``): how long, and
for what. Not imported from there: this module runs where MPI must not start (after srun)."""


def _error_type(st: dict[str, Any]) -> str:
    """The unqualified class name of a failed rank's error ('CollectiveError')."""
    return str(st.get("error", "")).split(":")[0].split(".")[-1]


def _hung(p: Placement, status: dict[int, dict[str, Any] | None]) -> list[str]:
    """Lines for the ranks that hung: named by a command's timeout on the controller (a
    ControlTimeout's peers) and still running when the launcher stopped the job, so neither
    answered nor failed. Ranks that failed collectives name as peers come first: another named
    rank may only have been waiting for them in a collective (a rank still in a phase at the
    timeout writes its stacks to its log: ``RankRuntime.phase``)."""
    lines: list[str] = []
    failed = [st for st in status.values() if st is not None and st.get("state") == "failed"]
    suspects = {int(r) for st in failed if _error_type(st) in SECONDARY and _error_type(st) != "ControlTimeout"
                for r in st.get("peers", ())}
    for st in failed:
        if _error_type(st) != "ControlTimeout" or not st.get("peers"):
            continue
        m = _WAITED.search(str(st.get("error", "")))
        what, within = (m["what"], f"within {float(m['secs']):.0f}s") if m else ("a command", "in time")
        stuck = [int(r) for r in st["peers"] if (status.get(int(r)) or {}).get("state") == "running"]
        for r in sorted(stuck, key=lambda r: (r not in suspects, r)):
            lines.append(f"{describe_rank(p, r)} hung in {what} on {(status[r] or {}).get('host')}: no answer {within} "
                         f"and no error of its own; the launcher stopped it with the rest")
    if len(lines) > 1:
        lines.append("(a rank waiting in a collective for one that hangs does not answer either; ranks that failed "
                     "collectives point at come first, and each rank's log ends with its stacks at the timeout)")
    return lines


def describe_rank(p: Placement, rank: int) -> str:
    slot = p.processes[rank]
    roles = ", ".join(f"{r}[{w}]" for r, w in slot.roles) or slot.kind.value
    where = f"GPU rank {slot.gpu_rank}, " if slot.gpu_rank is not None else ""
    return f"rank {rank} ({roles}; {where}node {slot.node})"


def _ranks_text(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 4-7, 9'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(x[0]) if len(x) == 1 else f"{x[0]}-{x[-1]}" for x in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def missing_run_dir(run_dir: Path, nodes: list[int], env: SchedulerEnv | None = None,
                    timeout_s: float = 60.0) -> dict[int, str]:
    """Inside the job's allocation: which of ``nodes`` (node index -> host) lack ``run_dir``.

    One srun task per node tests the directory; {} when there is no allocation to ask or the
    probe itself fails (then nothing is claimed)."""
    env = env or read_env()
    hosts = expand_hostlist(env.slurm_nodelist) if env.slurm_nodelist else []
    wanted = {n: hosts[n] for n in sorted(set(nodes)) if 0 <= n < len(hosts)}
    if not wanted:
        return {}
    test = f'test -d {shlex.quote(str(run_dir))} || echo "missing $SLURMD_NODENAME"'
    cmd = ["srun", "--mpi=none", f"--nodes={len(wanted)}", f"--ntasks={len(wanted)}", "--ntasks-per-node=1",
           f"--nodelist={','.join(wanted.values())}", "--cpus-per-task=1", "sh", "-c", test]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    gone = {line.split()[1] for line in out.splitlines() if line.startswith("missing ") and len(line.split()) == 2}
    return {n: h for n, h in wanted.items() if h in gone}


def culprits(p: Placement, run: RunDir, first_exits: list[int] | None = None) -> list[str]:
    """Lines naming the ranks that caused a failure, cause first. ``first_exits``: the ranks
    the launcher saw end first, in that order (``rlbatch.runtime.lifeline``; they may have exited
    cleanly)."""
    primary: list[str] = []
    secondary: list[str] = []
    never: list[str] = []
    silent: list[int] = []
    suspects: set[int] = set()  # peers named by the ranks whose collectives failed
    status = {rank: run.read_status(rank) for rank in range(p.world_size)}
    if missing := run.read_missing_on():
        return [f"run directory {run.path} missing on node {host}: "
                f"{_ranks_text([r for r in range(p.world_size) if p.processes[r].node == node])} (node {node}) "
                f"could not start; put run_dir on a filesystem every node sees" for node, host in sorted(missing.items())]
    for rank, st in status.items():
        who = describe_rank(p, rank)
        if st is None:
            never.append(f"{who} never started (no status file)")
        elif st["state"] == "failed":
            line = f"{who} failed on {st.get('host')}: {st.get('error', '?')}"
            if _error_type(st) in SECONDARY:
                secondary.append(line)
                suspects.update(int(r) for r in st.get("peers", ()))
            else:
                primary.append(line)
        elif st["state"] == "running":
            silent.append(rank)
    if primary:
        return primary
    if hung := _hung(p, status):
        return hung + secondary

    def host(r: int) -> object:
        return (status[r] or {}).get("host")

    first = [r for r in (first_exits or []) if r in silent]
    first = [r for r in first if r in suspects] or first
    if first:
        lines = [f"{describe_rank(p, first[0])} died first, without a word, on {host(first[0])}: "
                 f"killed by a signal or the OOM killer?"]
        if first[1:]:
            lines += [f"then {describe_rank(p, r)}" for r in first[1:]]
            lines.append("(mpiexec stopped those as the first ended; one may be the cause too if it died "
                         "at the same moment)")
        return lines
    # no launcher's view (the Slurm post-mortem): every silent rank, suspects first
    died = [f"{describe_rank(p, r)} died without a word on {host(r)}" for r in sorted(silent, key=lambda r: r not in suspects)]
    if len(died) > 1:
        died.append("(one of these was killed by a signal or the OOM killer; the launcher stopped the others)")
    return died + secondary + never


def main(argv: list[str]) -> int:
    """Print the ranks that brought a run down (nothing when every rank exited cleanly)."""
    from rlbatch.placement.io import load_placement

    run = RunDir(Path(argv[0]))
    p = load_placement(run.placement)
    status = {r: run.read_status(r) for r in range(p.world_size)}
    if all((st or {}).get("state") == "exited" for st in status.values()):
        return 0
    never = sorted({p.processes[r].node for r, st in status.items() if st is None})
    if never and (missing := missing_run_dir(run.path, never)):
        run.missing_on.write_text(json.dumps({str(n): h for n, h in missing.items()}))
    for line in culprits(p, run):
        print(f"rlbatch: {line}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
