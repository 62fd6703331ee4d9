"""Sandbox throughput: executions/s of the code sandbox against bare ``subprocess.run`` of the same
snippets (the floor: a fresh interpreter per snippet, no containment), at 1, 2 and 4 parallel
executions, in one run.

    python tools/bench/sandbox.py                 # 96 snippets per measurement
    python tools/bench/sandbox.py --snippets 24 --parallel 1 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from rlbatch.config.limits import Limits
from rlbatch.sandbox import isolation
from rlbatch.sandbox.runner import Job, Sandbox


def snippets(n: int) -> list[Job]:
    """Typical responses of a code task: a small function and three asserts (a third of them wrong)."""
    jobs = []
    for i in range(n):
        body = f"return x + {i % 7}" if i % 3 else f"return x * {i % 5}"
        jobs.append(Job(f"def f(x):\n    {body}\n", [f"assert f({k}) == {k} + {i % 7}" for k in (1, 2, 3)]))
    return jobs


def bare(jobs: list[Job], parallel: int) -> float:
    python = isolation.interpreter("process")

    def one(job: Job) -> None:
        subprocess.run([python, "-I", "-S", "-c", job.code + "\n" + "\n".join(job.tests)], capture_output=True,
                       timeout=60, check=False)

    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, jobs))
    return len(jobs) / (time.perf_counter() - start)


def sandboxed(jobs: list[Job], parallel: int, mode: str) -> float:
    box = Sandbox(Limits(), mode, workers=parallel)
    start = time.perf_counter()
    box.run_many(jobs)
    return len(jobs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snippets", type=int, default=96)
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds; the best of each is kept")
    args = ap.parse_args()
    jobs = snippets(args.snippets)
    modes = ["namespaces", "process"] if isolation.namespaces_available()[0] else ["process"]
    print(f"{args.snippets} snippets, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"best of {args.repeats} interleaved rounds")
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.repeats):
        for p in args.parallel:
            for kind in ["bare", *modes]:
                rate = bare(jobs, p) if kind == "bare" else sandboxed(jobs, p, kind)
                best[(kind, p)] = max(best.get((kind, p), 0.0), rate)
    print(f"{'parallel':>8}  {'bare subprocess.run':>20}  " + "  ".join(f"{m + ' (ratio)':>22}" for m in modes))
    for p in args.parallel:
        floor = best[("bare", p)]
        cells = "  ".join(f"{best[(m, p)]:>10.1f}/s ({best[(m, p)] / floor:.2f}x)" for m in modes)
        print(f"{p:>8}  {floor:>18.1f}/s  {cells}")


if __name__ == "__main__":
    main()
