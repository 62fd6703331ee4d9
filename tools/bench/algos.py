"""Each algorithm preset learns the default task: one run per preset, one table.

    python tools/bench/algos.py                       # every preset in conf/algo/ that runs, 80 steps
    python tools/bench/algos.py --algos grpo,dapo --steps 60

Each run is ``python -m rlbatch.launch algo=<preset> steps=<steps>`` on the default experiment
(single-digit addition mod 10 from a random-initialised model), one after the other. The table
gives the first step whose mean reward reaches the target, the training seconds up to it (the sum
of the steps' own times), the whole run's wall seconds (start-up included) and the final reward
(mean of the last 5 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRESETS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo")


def run(algo: str, steps: int, root: Path, extra: list[str]) -> dict[str, float | str]:
    run_dir = root / algo
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rlbatch.launch", f"algo={algo}", f"steps={steps}",
                          f"run_dir={run_dir}", *extra], cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"algo": algo, "error": out.stderr[-500:]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"algo": algo, "wall_s": wall, "rows": rows}  # type: ignore[dict-item]


def summarise(result: dict, target: float) -> str:
    if "error" in result:
        return f"| {result['algo']} | failed: {result['error'].splitlines()[-1] if result['error'] else ''} | | | |"
    rows = result["rows"]
    reached = next((k for k, r in enumerate(rows) if r["reward_mean"] >= target), None)
    train_s = sum(r["time/step"] for r in rows[: (reached + 1 if reached is not None else len(rows))])
    final = sum(r["reward_mean"] for r in rows[-5:]) / len(rows[-5:])
    first = rows[0]["reward_mean"]
    return (f"| {result['algo']} | {reached if reached is not None else 'not reached'} | {train_s:.1f} | "
            f"{result['wall_s']:.0f} | {first:.2f} → {final:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", default=",".join(PRESETS), help="comma-separated presets of conf/algo/")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="rlbatch-algos-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  steps={args.steps}  target reward {args.target}  "
          f"load average {os.getloadavg()[0]:.1f}  runs in {root}", flush=True)
    lines = ["| algorithm | first step >= target | train s to it | run wall s | reward first → last 5 |",
             "|---|---|---|---|---|"]
    for algo in args.algos.split(","):
        line = summarise(run(algo, args.steps, root, args.overrides), args.target)
        print(line, flush=True)
        lines.append(line)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
