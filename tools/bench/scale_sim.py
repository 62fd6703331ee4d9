"""The controller alone at thousands of ranks: its real loop, every other rank a stand-in that answers at once.

    python tools/bench/scale_sim.py [--ranks 256,1024,4096] [--samples 4] [--steps 6]

``tools/bench/scale.py`` runs whole worlds, every rank a process; on this machine that stops at a few
hundred ranks, and beyond ~64 its figures carry the cost of hundreds of processes sharing 2 cores.
This tool measures the one process whose cost grows with the world, the controller, at the sizes a
cluster has. It runs the controller's program (``rlbatch.loop.program.controller``: the GRPO loop,
the Pipeline, the scoring, the metrics, the control plane's ``Controller``) in this process, on the
placement the launcher would make for ``--ranks`` GPU ranks (the same overrides as scale.py's
colocated layout: the ``sleep`` engines for actor_train, actor_infer and the reference on every GPU
rank, one CPU reward worker), with a communicator whose ranks answer each command as soon as it is
sent, as a rank of that run would: a generation's lengths and versions, rewards, training stats,
the phase record a rank's residency makes (``rlbatch.loop.residency.PhaseRecord``).

Counted as the controller's: everything it does, including pickling each command and unpickling
each reply. Not counted: making the replies (the ranks' work), and the MPI calls themselves (a
send and a receive of a small pickled message cost ~3 us and ~5 us here, measured with mpi4py and
MPICH between two processes; the messages a step are printed so that they can be added). The
weight-sync probe (``cluster.sync_check_every``) is off: it runs once every 50 steps.

Printed per size: the controller's CPU ms a step (mean over the steps after the first two), the
messages a step, and that CPU as a share of a 30 s step; the last line:
``scale (simulated ranks): <N> ranks, controller CPU <X> ms a step = <P>% of a 30 s step``.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.bench.scale import STEP_S, overrides  # noqa: E402


class Sent:
    """A request from ``isend``: complete at once."""

    def wait(self) -> None:
        pass


class Reply:
    """A reply found by ``improbe``: its object and its rank."""

    def __init__(self, obj: object, source: int) -> None:
        self.obj, self.source = obj, source

    def recv(self, status: Any = None) -> object:
        if status is not None:
            status.Set_source(self.source)
        return self.obj


class Ranks:
    """The controller's communicator: each command is pickled (the controller's cost), and answered
    by its rank in order; the answer is made and pickled outside the controller's CPU time
    (``excluded_s``) and unpickled inside it, as a received message is."""

    def __init__(self, seed: int = 0) -> None:
        self.queue: list[tuple[int, bytes]] = []
        self.messages = 0
        self.excluded_s = 0.0
        self.rng = random.Random(seed)

    def isend(self, obj: object, dest: int, tag: int) -> Sent:
        self.queue.append((dest, pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)))
        self.messages += 1
        return Sent()

    def improbe(self, source: int, tag: int, status: Any = None) -> Reply | None:
        if not self.queue:
            return None
        start = time.process_time()
        rank, data = self.queue.pop(0)
        cmd, kwargs = pickle.loads(data)
        wire = pickle.dumps(self.answer(cmd, kwargs), pickle.HIGHEST_PROTOCOL)
        self.messages += 1
        self.excluded_s += time.process_time() - start
        return Reply(pickle.loads(wire), rank)

    def answer(self, cmd: str, kwargs: dict[str, Any]) -> object:
        """What a rank of the run replies to ``cmd`` (``RankRuntime.phase``'s reply for phases)."""
        from rlbatch.loop.residency import PhaseRecord
        from rlbatch.phases import PHASES

        if cmd != "phase":
            return None
        work, xfer = kwargs.get("work"), {"seconds": 0.0}
        if work is None:
            return {"xfer": xfer}
        op = PHASES[kwargs["phase"]].op
        ids = work.get("ids", [])
        out: object = {}
        if op == "generate":
            v = int(work["sampling"]["version"])
            out = {sid: (8, 64, (v, v)) for sid in ids}
        elif op == "score":
            out = {"rewards": {sid: float(self.rng.random() < 0.5) for sid in ids}, "counts": {}}
        elif op == "train" and "targets" in work:
            out = {"loss": 0.0, "grad_norm": 1.0, "lr": 1e-6}
        elif op == "sync":
            out = {"bytes": 0.0}
        rec = PhaseRecord(kwargs["phase"], tuple(kwargs["roles"]), seconds=0.01).as_dict()
        return {"out": out, "rec": rec, "xfer": xfer}


def run(ranks: int, samples_per_rank: int, steps: int, root: Path) -> tuple[float, float]:
    """The controller's program on ``ranks`` stand-in GPU ranks; (CPU seconds, messages) a step."""
    import torch

    import rlbatch.loop.controller as controller_module
    from rlbatch.checks.validate import check
    from rlbatch.config.compose import compose
    from rlbatch.config.load import load_config
    from rlbatch.launch.rundir import prepare_run_dir
    from rlbatch.loop import program
    from rlbatch.runtime.env import read_env
    from rlbatch.runtime.world import World, identify, role_world_ranks

    run_dir = root / f"r{ranks}"
    args = [*overrides(ranks, samples_per_rank, steps, 64, "colocated", run_dir), "cluster.sync_check_every=0",
            "resume=never", "logger=[]"]
    cfg = compose(args)
    placement = check(cfg)
    rundir = prepare_run_dir(cfg, placement)
    comm = Ranks()
    slot = identify(placement, read_env(), placement.controller_rank)
    assert slot is not None
    members = {name: role_world_ranks(placement, role) for name, role in placement.roles.items()}
    world = World(placement, slot, comm, {}, {}, {}, torch.device("cpu"), 600.0, members, data_comm=comm)  # type: ignore[arg-type]
    marks: list[tuple[float, int]] = []
    begin = controller_module.Pipeline.begin_step

    def begin_step(self: controller_module.Pipeline) -> None:
        marks.append((time.process_time() - comm.excluded_s, comm.messages))
        begin(self)

    controller_module.Pipeline.begin_step = begin_step  # type: ignore[method-assign]
    try:
        program.controller(world, load_config(rundir.config), rundir)
    finally:
        controller_module.Pipeline.begin_step = begin  # type: ignore[method-assign]
    timed = marks[2:]  # after the first two steps (start-up, first allocations)
    cpu = [b[0] - a[0] for a, b in zip(timed, timed[1:], strict=False)]
    msgs = [b[1] - a[1] for a, b in zip(timed, timed[1:], strict=False)]
    return statistics.mean(cpu), statistics.mean(msgs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="256,1024,4096", help="GPU ranks, comma-separated")
    ap.add_argument("--samples", type=int, default=4, help="samples per GPU rank per step")
    ap.add_argument("--steps", type=int, default=6, help="steps of each run (>= 4: the first two are left out)")
    ap.add_argument("--out", type=Path, default=None, help="directory of the runs (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error(f"--steps: {args.steps} < 4 (the first two steps are left out, a step is measured start to start)")
    sizes = [int(x) for x in args.ranks.split(",")]
    root = args.out or Path(tempfile.mkdtemp(prefix="rlbatch-scale-sim-"))
    print("| ranks | samples | ctl cpu ms | msgs | % of 30 s |\n|---|---|---|---|---|")
    last = (0, 0.0)
    for n in sizes:
        cpu_s, msgs = run(n, args.samples, args.steps, root)
        print(f"| {n} | {n * args.samples} | {cpu_s * 1e3:.1f} | {msgs:.0f} | {100 * cpu_s / STEP_S:.2f} |", flush=True)
        last = (n, cpu_s)
    n, cpu_s = last
    print(f"scale (simulated ranks): {n} ranks, controller CPU {cpu_s * 1e3:.0f} ms a step = "
          f"{100 * cpu_s / STEP_S:.2f}% of a {STEP_S:.0f} s step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
