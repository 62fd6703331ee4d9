"""Record small CPU runs of the default experiment for the planner's accuracy test.

    .venv/bin/python tools/record_runs.py [--steps 14] [--only colocated,wide] [--out tests/data/runs]

Runs ``python -m rlbatch.launch`` once per variant, strictly one after another, each into a
scratch run directory, and copies only what the planner reads (config.yaml, placement.json,
metrics.jsonl) into ``<out>/<variant>/``: logs, checkpoints (the final one is always written),
tensorboard files and plots stay behind. The uptime load average before and after each run is
printed because the machine is shared: note it in ``<out>/README.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEEP = ("config.yaml", "placement.json", "metrics.jsonl")

VARIANTS: dict[str, list[str]] = {
    # The default experiment: actor_train, actor_infer, reference take turns on 2 CPU "GPU" ranks.
    "colocated": [],
    # actor_train + reference on rank 0, actor_infer on rank 1.
    "disaggregated": ["roles=disaggregated"],
    # A 2x wider model (hidden 128, FFN 512).
    "wide": ["model.hidden_size=128", "model.intermediate_size=512"],
    # Half the samples per prompt (32 x 16 = 512 sequences a step).
    "samples16": ["algo.samples_per_prompt=16"],
    # Twice the prompts per step (64 x 32 = 2048 sequences a step).
    "prompts64": ["algo.prompts_per_step=64"],
}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def record(name: str, overrides: list[str], steps: int, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix=f"rlbatch-rec-{name}-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "rlbatch.launch", f"steps={steps}", "save_every=0", f"run_dir={run_dir}", *overrides]
        before = load()
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.time() - t0
        line = f"{name}: rc={proc.returncode} wall={wall:.1f}s load before [{before}] after [{load()}] cmd: {' '.join(cmd[1:])}"
        print(line, flush=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"{name} failed")
        dst = out / name
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        for f in KEEP:
            src = run_dir / f
            if not src.is_file():
                raise SystemExit(f"{name}: {src} missing; files: {sorted(p.name for p in run_dir.iterdir())}")
            text = src.read_text()
            if f == "config.yaml":  # the scratch path means nothing in the repository
                text = text.replace(str(run_dir), f"tests/data/runs/{name}")
            (dst / f).write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "tests/data/runs"))
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')} steps={a.steps} cpus={os.cpu_count()}", flush=True)
    for n in names:
        record(n, VARIANTS[n], a.steps, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
