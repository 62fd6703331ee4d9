"""Synthetic run directories in the pipeline's format, for testing calibrate and report.

Their times come from the planner itself with hidden "true" coefficients unlike the priors, plus
seeded noise, a slow first step and varying response lengths. They check the machinery
(reading runs, fitting, comparing); they say nothing about how well the model fits real runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml
from conftest import workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.models.shape import shape_from_config
from rlbatch.placement import place
from rlbatch.placement.io import save_placement
from rlbatch.plan.coefficients import Coefficients
from rlbatch.plan.layout import from_placement
from rlbatch.plan.predict import predict

TRUTH = Coefficients({
    "generate": {"roofline": 1.5, "overhead": 2.6, "fixed": 0.012},
    "logprobs": {"roofline": 1.3, "overhead": 2.0, "comm": 1.5, "fixed": 0.006},
    "train": {"roofline": 1.25, "overhead": 2.2, "comm": 1.5, "fixed": 0.009},
    "reward": {"overhead": 0.4, "fixed": 0.003},
    "sync": {"overhead": 1.8, "transfer": 1.5, "comm": 1.5, "fixed": 0.004},
    "offload": {"transfer": 1.6, "overhead": 1.5, "transitions": 0.0015},
    "reload": {"transfer": 1.6, "overhead": 1.5, "transitions": 0.0015},
    "step": {"fixed": 0.02},
})


def write_run(path: Path, cfg: dict[str, Any], truth: Coefficients = TRUTH, steps: int = 8, seed: int = 0,
              noise: float = 0.02) -> Path:
    """A run directory whose metrics the planner with ``truth`` would measure, plus noise."""
    path.mkdir(parents=True, exist_ok=True)
    placement = place(cfg)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    save_placement(placement, path / "placement.json")
    (path / "logs").mkdir(exist_ok=True)
    layout = from_placement(placement, int(cfg["cluster"]["cpus_per_task"]))
    shape, base, hw = shape_from_config(cfg["model"]), workload_of(cfg), load_hardware("cpu")
    rng = np.random.default_rng(seed)
    lines = []
    for step in range(steps):
        cap = base.max_new_tokens
        mean = float(rng.uniform(0.3, 1.0) * cap)
        longest = int(min(cap, np.ceil(mean * rng.uniform(1.2, 2.0))))
        gen, total = base.sequences * mean, base.sequences * (base.prompt_len + mean)
        p = predict(layout, shape, base.with_measured(gen, total, longest), hw, "auto", truth)
        warm = 3.0 if step == 0 else 1.0

        def t(x: float, warm: float = warm) -> float:
            return float(x * warm * (1 + noise * rng.standard_normal()))

        rec: dict[str, Any] = {"step": step, "reward_mean": 0.0, "time/step": t(p.step_s)}
        rec |= {f"time/{ph.name}": t(ph.seconds) for ph in p.phases}
        rec |= {"time/offload": t(p.offload_s), "time/reload": t(p.reload_s),
                "offload/bytes": 0, "reload/bytes": 0, "tokens/generated": gen, "tokens/total": total,
                "tokens/response_max": longest, "host/rss": 1e9}
        rec |= {f"mem/{r}/peak_allocated": 0 for r in layout.roles}
        lines.append(rec)
    (path / "metrics.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in lines))
    return path
