"""Faults a user meets, run against real launches on this machine, each with its checks.

    python tools/faults.py                    # every scenario
    python tools/faults.py --only disk_full   # one (ctrl_c, disk_full, hang, two_launches, sandbox)
    python tools/faults.py --work DIR --json PATH

Each scenario is a module in ``tools/fault_scenarios/`` with ``scenario(work) -> [(check, ok,
detail)]``: it starts ``python -m rlbatch.launch`` (the small default experiment, cluster=local)
or the sandbox worker, does to it what a user or a hostile response would (Ctrl-C, a full disk,
a rank that hangs, a second launch into the same run directory, code that attacks the sandbox), and reports what
happened with the numbers. Exit code 1 when a check fails. The same behaviours are tested in
CI by the tests each scenario names; this prints the evidence in one place.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "tools" / "fault_scenarios"
sys.path.insert(0, str(ROOT))  # this checkout's rlbatch
sys.path.insert(0, str(SCENARIOS.parent))


def names() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.py") if not p.stem.startswith("_"))


def run_one(name: str, work: Path) -> tuple[list[tuple[str, bool, str]], float]:
    start = time.perf_counter()
    module = importlib.import_module(f"fault_scenarios.{name}")
    where = work / name
    where.mkdir(parents=True, exist_ok=True)
    try:
        checks = list(module.scenario(where))
    except Exception:  # a scenario that breaks is a failed check, with its traceback
        checks = [("scenario ran", False, traceback.format_exc(limit=8).strip())]
    return checks, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=names(), help="run this scenario (repeatable)")
    p.add_argument("--work", default=str(ROOT / ".test-runs" / "faults"), help="run directories go here")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    work = Path(args.work).resolve()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    results, failed = [], 0
    for name in args.only or names():
        print(f"\n== {name}", flush=True)
        checks, seconds = run_one(name, work)
        for check, ok, detail in checks:
            print(f"{'ok  ' if ok else 'FAIL'} {check}: {detail}")
            failed += not ok
        print(f"({seconds:.0f} s)")
        results.append({"scenario": name, "seconds": seconds,
                        "checks": [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks]})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n{failed} check(s) failed" if failed else "\nevery check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
