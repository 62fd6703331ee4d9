"""What rlbatch's own machinery costs as the world grows: the real launcher, controller, MPI control
plane, phase scheduler, placement and data plane, with engines that do no model work.

    python tools/bench/scale.py [--ranks 4,16,64,128,256] [--samples 1,4] [--steps 4]
                                [--response-tokens 64] [--layout colocated]

Each size is a real run: ``python -m rlbatch.launch`` (mpiexec, ``rlbatch.worker`` on every rank,
the GRPO loop on the controller) with ``cluster.device=cpu`` (every GPU rank a process with a CPU
"device", 8 to a logical node), the ``sleep`` engines (``rlbatch.engines.sleep``: a modelled time
per call, responses of ``--response-tokens`` tokens) on every GPU rank for actor_train,
actor_infer and the reference, and one CPU reward worker. ``--samples`` is samples per GPU rank
per step (prompts_per_step x samples_per_prompt = that x ranks, 4 samples a prompt).

The ranks are as light as the runtime allows: the sleep engines need no torch.distributed world
(``EngineSpec.needs_torch_world``), so none is started and the samples move over MPI
(``rlbatch.runtime.mpi_dataplane``); and every rank of the node is forked from one process that
has imported torch already (``RLBATCH_FORKSERVER=1``, ``rlbatch.runtime.zygote``), so the ranks
share those pages instead of holding ~150 MB each (``--no-forkserver``: every rank on its own).

The controller appends a snapshot at every step's start (``RLBATCH_CONTROL_STATS``:
``rlbatch.runtime.control.Controller.mark``): wall and CPU seconds, RSS, the control plane's
counters (commands and replies, their pickled bytes) and the data plane's (rank-to-rank messages
and bytes of the moves it ordered). Per step is the mean over the steps after the first. Printed
per world size and samples per rank:

  wall ms         the step's wall time: the engines take no time, so all of it is outside engine
                  work (rlbatch's own: the controller, the ranks' command handling, the data moves)
  ctl cpu ms      the controller process's CPU time a step
  ctl busy ms     of which its work: less the polls that found no reply yet (the ranks still at
                  work; ``Traffic.idle_cpu_s``) and the second pickling that counts the bytes
                  (``counting_cpu_s``): the control overhead (below)
  ctl rss MB      its resident memory at the last step
  ctl msgs, KB    messages and bytes a step through the controller (commands + replies)
  r2r msgs, KB    messages and bytes a step rank to rank (sample moves)
  start s         launch to the first step (mpiexec, imports, world, engines, ready)
  pss MB/rank     the job's proportional memory (PSS, shared pages split), every process of it (the
                  ranks, and with the forkserver their stubs and the node's zygote), per rank of the
                  world (GPU ranks, the reward worker, the controller), at its peak

The last line: ``scale: <N> ranks, control overhead <X> ms a step = <P>% of a 30 s step; predicted
<Q>% at 4096 ranks`` (the largest size run, the fit of ``rlbatch.plan.control``).

The control overhead is the controller's busy CPU time a step. The controller is one process on
the critical path of every step; with a core per rank (a real node) its work plus a round trip per
phase is what the ranks wait for it. The CPU it spends polling while the ranks work delays nothing
there; here it grows with the ranks (the step's wall time does, below), so it is counted apart. On a
machine with fewer cores than processes (2 cores for up to 258 processes here) the step's wall time
is the sum of every process's work shared out over the cores: it is printed, and it bounds nothing
on a cluster. The controller gets a CPU of its own (the first; the ranks share the others) unless
``--no-pin``: sharing both with hundreds of ranks, its CPU time also counted being switched out
hundreds of times a step.

``tools/bench/scale_sim.py`` measures the controller alone at the sizes this machine cannot run as
processes (its real loop, every rank a stand-in that answers at once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from rlbatch.plan.control import ControlModel, Point, fit  # noqa: E402
from rlbatch.runtime.zygote import ENV as ZYGOTE_ENV  # noqa: E402

STEP_S = 30.0
"""The step the overhead is judged against."""
GPUS_PER_NODE = 8
PSS_MB_PER_PROCESS = 220
"""A rank of a running job started on its own, measured here (190-220 MB PSS: torch's import alone is
~150 MB private); ``--no-forkserver``."""
PSS_MB_PER_FORKED = 45
"""A rank forked from its node's zygote (``rlbatch.runtime.zygote``, the default here), with its
stub: the pages of torch's import shared by all."""
SAMPLES_PER_PROMPT = 4


@dataclass
class Result:
    ranks: int
    processes: int
    samples_per_rank: int
    samples: int
    wall_ms: float
    ctl_cpu_ms: float
    ctl_busy_ms: float
    ctl_rss_mb: float
    ctl_msgs: float
    ctl_kb: float
    r2r_msgs: float
    r2r_kb: float
    start_s: float
    pss_mb_per_rank: float


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemoryWatch:
    """The peak of the launched job's summed PSS (every descendant process), sampled each second;
    with ``pin`` (a run directory and the controller's rank) the controller's threads are kept on
    the first CPU and every other process's on the rest (``pin_controller``)."""

    def __init__(self, pid: int, pin: tuple[Path, int] | None = None) -> None:
        self.pid, self.peak_kb, self.procs, self.pin = pid, 0, 0, pin
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            pids = [p for p in _descendants(self.pid)]
            if self.pin is not None:
                pin_controller(pids, _status_pid(*self.pin))
            total = sum(_pss_kb(p) for p in pids)
            if total > self.peak_kb:
                self.peak_kb, self.procs = total, len(pids)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _status_pid(run_dir: Path, rank: int) -> int | None:
    """The pid a rank's status file records (it writes one as it starts), or None before that."""
    try:
        return int(json.loads((run_dir / "logs" / f"rank{rank}.status").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def pin_controller(pids: list[int], controller: int | None) -> None:
    """Give the controller process a CPU of its own: every thread of it on the first CPU this
    harness may use, every thread of every other process in ``pids`` on the others. On a cluster
    the controller has a core to itself; on a machine with a few cores for hundreds of ranks it
    otherwise shares them with every rank, and its CPU time a step then also counts the cache and
    scheduler misses of being switched out hundreds of times a step (the overhead measured grew
    faster than the work it does). A process that has exited meanwhile is skipped."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or controller is None:
        return
    mine, others = {cpus[0]}, set(cpus[1:])
    for pid in pids:
        want = mine if pid == controller else others
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                if os.sched_getaffinity(tid) != want:
                    os.sched_setaffinity(tid, want)
            except OSError:
                pass


def overrides(ranks: int, samples_per_rank: int, steps: int, tokens: int, layout: str, run_dir: Path) -> list[str]:
    """The launcher's overrides for one size: the sleep engines on ``ranks`` logical GPU ranks."""
    prompts = max(1, ranks * samples_per_rank // SAMPLES_PER_PROMPT)
    if layout == "colocated":
        train = infer = f'"list(range(0,{ranks}))"'
        dt = di = ranks
    else:  # disaggregated: trainer (and reference) on the first half, inference on the second
        half = ranks // 2
        train, infer = f'"list(range(0,{half}))"', f'"list(range({half},{ranks}))"'
        dt, di = half, ranks - half
    return [
        "plugins=[rlbatch.engines.sleep]", "cluster.device=cpu", f"cluster.gpus_per_node={GPUS_PER_NODE}",
        "cluster.timeout_s=900", "cluster.startup_timeout_s=1800",
        f"roles.actor_train.device_mapping={train}", f"roles.actor_train.backend=sleep_train:d{dt}",
        f"roles.reference.device_mapping={train}", "roles.reference.backend=",
        f"roles.actor_infer.device_mapping={infer}", f"roles.actor_infer.backend=sleep:d{di}",
        f"+roles.actor_infer.engine_args.response_tokens={tokens}",
        "roles.reward.world_size=1", f"algo.prompts_per_step={prompts}", f"algo.samples_per_prompt={SAMPLES_PER_PROMPT}",
        f"algo.max_new_tokens={tokens}", f"steps={steps}", "save_every=0", f"run_dir={run_dir}",
    ]


def per_step(marks: list[dict[str, float]], key: str) -> float:
    """Mean increase of ``key`` a step, over the steps after the first (warm-up)."""
    deltas = [b[key] - a[key] for a, b in zip(marks[1:], marks[2:], strict=False)]
    return statistics.mean(deltas) if deltas else float("nan")


def memory_problem(ranks: int, forked: bool = True) -> str | None:
    """Why ``ranks`` GPU ranks (and the reward worker and the controller) do not fit in this
    machine's available memory, or None."""
    try:
        avail_mb = next(int(ln.split()[1]) // 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                        if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    each = PSS_MB_PER_FORKED if forked else PSS_MB_PER_PROCESS
    need_mb = (ranks + 2) * each
    if need_mb > 0.8 * avail_mb:
        return (f"--ranks {ranks}: {ranks + 2} processes x ~{each} MB = {need_mb} MB, more than 80% of "
                f"the {avail_mb} MB available here")
    return None


def _every_rank_exited(run_dir: Path, world: int) -> bool:
    """Every rank's status file says it exited with code 0."""
    for r in range(world):
        try:
            st = json.loads((run_dir / "logs" / f"rank{r}.status").read_text())
        except (OSError, ValueError):
            return False
        if st.get("state") != "exited" or st.get("code") != 0:
            return False
    return True


def run_one(ranks: int, samples_per_rank: int, args: argparse.Namespace, root: Path) -> Result:
    run_dir = root / f"r{ranks}_s{samples_per_rank}"
    stats = run_dir.parent / f"{run_dir.name}.control.jsonl"
    stats.unlink(missing_ok=True)
    env = dict(os.environ, RLBATCH_CONTROL_STATS=str(stats), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env[ZYGOTE_ENV] = "0" if args.no_forkserver else "1"
    cmd = [sys.executable, "-m", "rlbatch.launch",
           *overrides(ranks, samples_per_rank, args.steps, args.response_tokens, args.layout, run_dir)]
    start = time.time()
    with open(root / f"{run_dir.name}.out", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        watch = MemoryWatch(proc.pid, None if args.no_pin else (run_dir, ranks + 1))
        try:
            rc = proc.wait(timeout=args.timeout)
        finally:
            watch.stop()
            if proc.poll() is None:
                proc.kill()
    if rc != 0 and _every_rank_exited(run_dir, ranks + 2):
        # Seen with the forkserver: every rank done and exited 0, then mpiexec reports one of its
        # processes killed (signal 9) as the job ends. The measurement is complete; say so.
        print(f"warning: {ranks} ranks: mpiexec exited {rc} after every rank had exited 0 (see "
              f"{root / (run_dir.name + '.out')})", file=sys.stderr, flush=True)
    elif rc != 0:
        raise RuntimeError(f"{ranks} ranks, {samples_per_rank} samples/rank: the run failed (exit code {rc}); "
                           f"see {root / (run_dir.name + '.out')}")
    marks = [json.loads(line) for line in stats.read_text().splitlines()]
    if len(marks) < 3:
        raise RuntimeError(f"{stats}: {len(marks)} step marks; --steps must be at least 3")
    step_s = per_step(marks, "t")
    return Result(
        ranks=ranks, processes=ranks + 2, samples_per_rank=samples_per_rank,
        samples=max(1, ranks * samples_per_rank // SAMPLES_PER_PROMPT) * SAMPLES_PER_PROMPT,
        wall_ms=step_s * 1e3, ctl_cpu_ms=per_step(marks, "cpu_s") * 1e3,
        ctl_busy_ms=(per_step(marks, "cpu_s") - per_step(marks, "idle_cpu_s") - per_step(marks, "counting_cpu_s")) * 1e3,
        ctl_rss_mb=marks[-1]["rss_kb"] / 1024, ctl_msgs=per_step(marks, "commands") + per_step(marks, "replies"),
        ctl_kb=(per_step(marks, "command_bytes") + per_step(marks, "reply_bytes")) / 1024,
        r2r_msgs=per_step(marks, "data_messages"), r2r_kb=per_step(marks, "data_bytes") / 1024,
        start_s=marks[0]["wall"] - start, pss_mb_per_rank=watch.peak_kb / 1024 / (ranks + 2),
    )


HEADER = ("ranks", "procs", "smp/rank", "samples", "wall ms", "ctl cpu ms", "ctl busy ms", "ctl rss MB", "ctl msgs", "ctl KB",
          "r2r msgs", "r2r KB", "start s", "pss MB/rank")


def row(r: Result) -> tuple[str, ...]:
    return (str(r.ranks), str(r.processes), str(r.samples_per_rank), str(r.samples), f"{r.wall_ms:.1f}",
            f"{r.ctl_cpu_ms:.1f}", f"{r.ctl_busy_ms:.1f}", f"{r.ctl_rss_mb:.0f}", f"{r.ctl_msgs:.0f}", f"{r.ctl_kb:.1f}", f"{r.r2r_msgs:.0f}",
            f"{r.r2r_kb:.1f}", f"{r.start_s:.1f}", f"{r.pss_mb_per_rank:.0f}")


def table(results: list[Result]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines)


def summary(results: list[Result], model: ControlModel) -> str:
    big = max(results, key=lambda r: (r.ranks, r.samples_per_rank))
    pct = 100 * big.ctl_busy_ms / 1e3 / STEP_S
    q = 100 * model.overhead_s(4096) / STEP_S
    return (f"scale: {big.ranks} ranks, control overhead {big.ctl_busy_ms:.0f} ms a step = {pct:.2f}% of a "
            f"{STEP_S:.0f} s step; predicted {q:.2f}% at 4096 ranks")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4,16,64", help="GPU ranks of each run, comma-separated")
    ap.add_argument("--samples", default="4", help="samples per GPU rank per step, comma-separated")
    ap.add_argument("--steps", type=int, default=4, help="steps of each run (the first is warm-up; >= 3)")
    ap.add_argument("--response-tokens", type=int, default=64)
    ap.add_argument("--layout", choices=("colocated", "disaggregated"), default="colocated")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    ap.add_argument("--out", type=Path, default=None, help="directory of the runs (default: a temporary one)")
    ap.add_argument("--force", action="store_true", help="run sizes that may not fit in the available memory")
    ap.add_argument("--no-forkserver", action="store_true",
                    help="start every rank on its own (each imports torch) instead of forking the ranks of a node "
                         "from one process that has (rlbatch.runtime.zygote)")
    ap.add_argument("--no-pin", action="store_true",
                    help="leave the controller sharing every CPU with the ranks (default: a CPU of its own)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error(f"--steps: {args.steps} < 3 (the first step is warm-up, and a step is measured start to start)")
    sizes = [int(x) for x in args.ranks.split(",")]
    if any(n < 1 for n in sizes) or (args.layout == "disaggregated" and any(n < 2 for n in sizes)):
        ap.error(f"--ranks: {sizes}: each at least 1 (2 for --layout disaggregated)")
    if not args.force and (problems := [p for n in sizes if (p := memory_problem(n, not args.no_forkserver))]):
        ap.error("; ".join(problems) + " (--force runs it anyway)")
    root = args.out or Path(tempfile.mkdtemp(prefix="rlbatch-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    for n in sizes:
        for s in (int(x) for x in args.samples.split(",")):
            r = run_one(n, s, args, root)
            results.append(r)
            print(" ".join(f"{h}={v}" for h, v in zip(HEADER, row(r), strict=True)), flush=True)
    print(table(results))
    points = [Point(r.ranks, r.ctl_busy_ms / 1e3) for r in results if r.samples_per_rank == max(
        x.samples_per_rank for x in results if x.ranks == r.ranks)]
    model = fit(points, "tools/bench/scale.py")
    print(f"fit: {model.describe()}")
    for n in (1024, 4096):
        print(f"predicted at {n} ranks: {model.overhead_s(n) * 1e3:.0f} ms a step = "
              f"{100 * model.overhead_s(n) / STEP_S:.2f}% of a {STEP_S:.0f} s step")
    if args.json:
        args.json.write_text(json.dumps({"results": [asdict(r) for r in results], "fit": asdict(model)}, indent=1))
    print(summary(results, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
