"""What a launch costs before its first step: the dry run, and the default experiment's start.

    python tools/bench/launch.py [--runs 3] [--steps 1] [ARGS ...]

Prints, as medians over --runs launches:
  dry run          wall seconds of ``python -m rlbatch.launch dry_run=true``
  run              wall seconds of ``python -m rlbatch.launch steps=<--steps> ARGS`` (the default
                   experiment unless ARGS say otherwise), its CPU seconds (every process: the launcher,
                   mpiexec, the ranks), and the "engines ready on every rank in X s" it prints
  per rank         each process's CPU seconds, its wall seconds from start to exit, and which heavy
                   packages it imported (torch, transformers, vllm, sglang, deepspeed, megatron, peft,
                   datasets, trackers, math-verify, matplotlib, ...)

The per-rank figures come from a ``sitecustomize`` this script puts first on PYTHONPATH: at exit
each process writes its CPU time, its lifetime and its imported top-level packages to a file
(only processes that exit normally; rlbatch's own code is not changed for it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "tokenizers", "vllm", "sglang", "deepspeed", "megatron", "triton", "peft",
         "datasets", "pyarrow", "wandb", "mlflow", "math_verify", "sympy", "matplotlib", "tensorboard", "scipy")

SITECUSTOMIZE = """
import atexit, json, os, sys, time
_t0 = time.time()
def _report():
    out = os.environ.get("RLBATCH_BENCH_PROC_DIR")
    if not out:
        return
    heavy = os.environ["RLBATCH_BENCH_HEAVY"].split(",")
    rank = os.environ.get("PMI_RANK", "launcher" if "rlbatch/launch" in sys.argv[0] else "other")
    row = {"rank": rank, "argv": " ".join(sys.argv)[:120], "cpu_s": time.process_time(),
           "wall_s": time.time() - _t0, "imported": [m for m in heavy if m in sys.modules]}
    with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
        json.dump(row, f)
atexit.register(_report)
"""


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def launch(args: list[str], work: Path, procs: Path | None = None) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds of every process, and stdout of one launch."""
    env = dict(os.environ)
    site = work / "site"
    paths = [str(site), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if procs is not None:
        env["RLBATCH_BENCH_PROC_DIR"], env["RLBATCH_BENCH_HEAVY"] = str(procs), ",".join(HEAVY)
    cpu0, t0 = _children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rlbatch.launch", *args], cwd=work, env=env, capture_output=True,
                         text=True, timeout=900)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if out.returncode != 0:
        sys.exit(f"launch {args} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return wall, cpu, out.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("args", nargs="*", help="overrides for the run (the dry run takes them too)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO / ".bench-runs" if (REPO / ".bench-runs").is_dir() else None) as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        dry = [launch(["dry_run=true", f"run_dir={work / 'dry'}", *a.args], work)[0] for _ in range(a.runs)]
        walls, cpus, ready, ranks = [], [], [], []
        for i in range(a.runs):
            procs = work / f"procs{i}"
            procs.mkdir()
            wall, cpu, stdout = launch([f"steps={a.steps}", f"run_dir={work / f'run{i}'}", *a.args], work, procs)
            m = re.search(r"engines ready on every rank in ([0-9.]+)s", stdout)
            walls.append(wall), cpus.append(cpu), ready.append(float(m.group(1)) if m else float("nan"))
            ranks.append([json.loads(f.read_text()) for f in sorted(procs.glob("*.json"))])
    print(f"dry run:        {statistics.median(dry):6.2f} s wall (min {min(dry):.2f}, max {max(dry):.2f})")
    print(f"run (steps={a.steps}):  {statistics.median(walls):6.2f} s wall, {statistics.median(cpus):6.1f} CPU-s in all "
          f"processes, engines ready in {statistics.median(ready):.2f} s (runs: {len(walls)})")
    last = sorted(ranks[-1], key=lambda r: (r["rank"] == "launcher", str(r["rank"])))
    print(f"{'process':<10} {'CPU s':>6} {'wall s':>7}  heavy packages imported")
    for r in last:
        if r["rank"] != "other":
            print(f"{r['rank']:<10} {r['cpu_s']:6.1f} {r['wall_s']:7.1f}  {' '.join(r['imported']) or '-'}")


if __name__ == "__main__":
    main()
