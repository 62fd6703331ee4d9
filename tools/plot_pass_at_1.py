"""Plot a run's held-out pass@1 against steps and wall time (as docs/smollm2_arithmetic.png).

    python tools/plot_pass_at_1.py runs/<run> docs/smollm2_arithmetic.png "SmolLM2-135M-Instruct, ..."

Reads ``<run>/metrics.jsonl``: pass@1 from ``eval/all/pass@1`` (with ``eval.at_start`` step 0's row
holds the evaluation of the initial weights), wall time from ``time/step`` plus the evaluations that
did not overlap a step; prints the points it plots.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def points(rows: list[dict[str, float]]) -> list[tuple[int, float, float]]:
    """(training steps done, seconds since the first step began, pass@1) per evaluation."""
    out, elapsed = [], 0.0
    for i, r in enumerate(rows):
        if i == 0 and "eval/all/pass@1" in r:  # before training: the initial weights
            out.append((0, 0.0, r["eval/all/pass@1"]))
        elapsed += r["time/step"] + (r.get("eval/seconds", 0.0) if not r.get("eval/overlapped", 0.0) else 0.0)
        if i > 0 and "eval/all/pass@1" in r:
            out.append((int(r["step"]) + 1, elapsed, r["eval/all/pass@1"]))
    return out


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, out, title = Path(argv[0]), Path(argv[1]), argv[2] if len(argv) > 2 else ""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    pts = points(rows)
    reward = [(int(r["step"]) + 1, r["reward_mean"]) for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([p[0] for p in pts], [100 * p[2] for p in pts], "o-", label="held-out pass@1 (greedy)")
    a.plot([s for s, _ in reward], [100 * v for _, v in reward], "-", alpha=0.5, label="training reward (sampled)")
    a.set_xlabel("training steps done")
    a.set_ylabel("%")
    a.set_ylim(0, 100)
    a.legend()
    a.grid(alpha=0.3)
    b.plot([p[1] / 60 for p in pts], [100 * p[2] for p in pts], "o-")
    b.set_xlabel("minutes after start-up (initial evaluation included)")
    b.set_ylabel("held-out pass@1 (%)")
    b.set_ylim(0, 100)
    b.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    for step, secs, value in pts:
        print(f"step {step:3d}  {secs / 60:6.1f} min  pass@1 {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
