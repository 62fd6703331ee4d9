"""A step's metrics: metrics.jsonl (one JSON object per step), TensorBoard, the enabled experiment
trackers (W&B, MLflow: ``rlbatch.trackers``), progress bar, plot.

Per-phase records from every rank are reduced here: times and bytes as the maximum over ranks
(the slowest rank sets the pace), device memory as the peak per role, host RSS (after each phase,
and its peak per phase and at start-up) as the maximum.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlbatch.loop.residency import RecordDict
from rlbatch.loop.samples import keep_before
from rlbatch.runtime.rundir import RunDir
from rlbatch.trackers.session import open_trackers

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from rlbatch.loop.controller import Rollouts

log = logging.getLogger(__name__)
Row = dict[str, float]
"""One step's metrics row, a line of metrics.jsonl: ``step`` and every metric by name."""
METRICS = "metrics.jsonl"
CURVE = "reward_curve.png"
EVAL_CURVE = "eval_curve.png"


def reduce_records(records: Sequence[RecordDict]) -> dict[str, float]:
    """The step's per-rank phase records reduced: offload and reload bytes and seconds summed per
    rank, then the maximum over ranks; device memory as the peak per role and the most reserved;
    host RSS after each phase, its peak per phase and at start-up, as the maximum; the weight syncs'
    bytes summed. One pass, with each metric's name made once a step (a step of 4096 ranks has
    ~25,000 records)."""
    per_rank: dict[int, list[float]] = {}  # rank -> [offload bytes, reload bytes, offload s, reload s]
    out: dict[str, float] = {}
    peak_of: dict[str, str] = {}  # role -> its metric's name
    host_peak_of: dict[str, str] = {}  # phase -> its metric's name
    for rec in records:
        acc = per_rank.get(rec["rank"])
        if acc is None:
            acc = per_rank[rec["rank"]] = [0.0, 0.0, 0.0, 0.0]
        off, back = rec["offload"], rec["reload"]
        acc[0] += off["bytes"]
        acc[1] += back["bytes"]
        acc[2] += off["seconds"]
        acc[3] += back["seconds"]
        peak = float(rec["peak_allocated"])
        for role in rec["roles"]:
            key = peak_of.get(role) or peak_of.setdefault(role, f"mem/{role}/peak_allocated")
            if peak >= out.get(key, 0.0):
                out[key] = peak
        if "sync_bytes" in rec:  # the step's weight syncs: bytes moved (rlbatch.loop.controller.Role.sync_weights)
            out["sync/bytes"] = out.get("sync/bytes", 0.0) + float(rec["sync_bytes"])
        out["mem/reserved"] = max(out.get("mem/reserved", 0.0), float(rec["mem_reserved_after"]))
        out["host/rss"] = max(out.get("host/rss", 0.0), float(rec["rss_after"]))
        # Peak RSS per phase and of the start-up, the maximum over ranks (0: not measured).
        if peak := rec.get("rss_peak", 0):
            phase = rec["phase"]
            key = host_peak_of.get(phase) or host_peak_of.setdefault(phase, f"host/peak/{phase}")
            out[key] = max(out.get(key, 0.0), float(peak))
        if peak := rec.get("rss_peak_startup", 0):
            out["host/peak/startup"] = max(out.get("host/peak/startup", 0.0), float(peak))
    for k, key in enumerate(("offload/bytes", "reload/bytes", "time/offload", "time/reload")):
        out[key] = max((acc[k] for acc in per_rank.values()), default=0.0)
    return out


class Metrics:
    def __init__(self, run: RunDir, steps: int, start: int = 0, tensorboard: bool = True, plot_every: int = 0) -> None:
        """``plot_every``: redraw the curves every N steps while the run trains (0: at ``close`` only)."""
        self.run, self.plot_every = run, plot_every
        self.path = run.path / METRICS
        self.history: list[Row] = []
        self.tb: SummaryWriter | None = None
        if tensorboard:  # ``logger`` lists it (the default)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run.path / "tensorboard"))
            except ImportError:  # tensorboard is a core dependency; a broken install still trains
                log.warning("tensorboard is not importable: no event files will be written")
        self.steps, self.start = steps, start
        self.bar: tqdm[int] | None = None
        # resuming: keep the rows before the checkpoint, drop any after it (a line cut by a crash too)
        self.history = keep_before(self.path, start)
        # W&B and MLflow (trackers.*), on the controller only: this object lives nowhere else.
        self.trackers = open_trackers(run.path, self.history, start)

    def progress(self, steps: Iterable[int]) -> Iterator[int]:
        from tqdm import tqdm

        self.bar = tqdm(steps, total=self.steps - self.start, desc="rlbatch", unit="step", dynamic_ncols=True)
        yield from self.bar

    def log(self, row: Row) -> None:
        self.history.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])
        if self.trackers is not None:
            self.trackers.log(self.history)
        log.info(progress_line(row, self.steps, self.history))  # the controller's log: tail -f shows each step
        if self.plot_every and (int(row["step"]) + 1) % self.plot_every == 0:
            self.plot()
        if self.bar is not None:
            phases = " ".join(f"{k[5:]}={row[k]:.2f}s" for k in row if k.startswith("time/") and k not in ("time/offload", "time/reload"))
            held_out = f"eval_pass@1={row['eval/all/pass@1']:.3f} " if "eval/all/pass@1" in row else ""
            self.bar.set_postfix_str(f"reward={row['reward_mean']:.3f} {held_out}{phases}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.trackers is not None:
            self.trackers.close(completed=bool(self.history) and self.history[-1]["step"] >= self.steps - 1)
        self.plot()

    def plot(self) -> None:
        """Draw the reward curve (and the held-out evaluation's) from the rows so far."""
        if self.history:
            plot_reward(self.history, self.run.path / CURVE)
        if any("eval/all/pass@1" in r for r in self.history):
            plot_eval(self.history, self.run.path / EVAL_CURVE)


def progress_line(row: Row, steps: int, history: Sequence[Row]) -> str:
    """One line per step for the controller's log (and so the Slurm output file): the step, its
    reward, the held-out pass@1 when evaluated, its seconds by phase, and the time left at the mean
    step time so far."""
    step = int(row["step"])
    parts = [f"step {step + 1}/{steps}", f"reward {float(row['reward_mean']):.3f}"]
    if "eval/all/pass@1" in row:
        parts.append(f"held-out pass@1 {float(row['eval/all/pass@1']):.3f}")
    phases = ", ".join(f"{k[5:]} {float(row[k]):.1f}s" for k in row
                       if k.startswith("time/") and k not in ("time/step", "time/offload", "time/reload"))
    seconds = float(row.get("time/step", 0.0))
    parts.append(f"{seconds:.1f}s" + (f" ({phases})" if phases else ""))
    timed = [float(r["time/step"]) for r in history if "time/step" in r]
    if timed and step + 1 < steps:
        left = (steps - step - 1) * sum(timed) / len(timed)
        parts.append(f"about {_duration(left)} left")
    return "; ".join(parts)


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def value_limits(values: Iterable[float]) -> tuple[float, float]:
    """The y-range of a plot of ``values``: the unit range (with a margin) when every value lies in
    [0, 1] (a pass rate reads best against it), else the values' own range with 5% margins, so a
    reward model's scores and negative shaped rewards are never cut. Non-finite values are left out."""
    finite = [float(v) for v in values if math.isfinite(float(v))]
    if not finite or (min(finite) >= 0.0 and max(finite) <= 1.0):
        return -0.02, 1.02
    lo, hi = min(finite), max(finite)
    pad = 0.05 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1.0)
    return lo - pad, hi + pad


def plot_reward(history: Sequence[Mapping[str, float]], path: Path) -> tuple[float, float]:
    """The mean reward per step (and the mean shaped reward, where shaping changed it: DAPO's
    overlong penalty, a KL penalty in the reward) into ``path``; returns the y-range drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    series = {"reward_mean": [float(r["reward_mean"]) for r in history]}
    shaped = [float(r.get("reward_shaped_mean", r["reward_mean"])) for r in history]
    if shaped != series["reward_mean"]:
        series["reward_shaped_mean"] = shaped
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    for (name, values), marker in zip(series.items(), ("o", "x"), strict=False):
        ax.plot(steps, values, marker=marker, markersize=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(*value_limits(v for values in series.values() for v in values))
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(loc="best")
    ax.set_title("rlbatch: mean reward per step")
    fig.tight_layout()
    fig.savefig(path)
    limits = ax.get_ylim()
    plt.close(fig)
    return float(limits[0]), float(limits[1])


def plot_eval(history: Sequence[Mapping[str, float]], path: Path) -> None:
    """pass@1 and mean reward of the held-out evaluations (``rlbatch.loop.evaluation``) over the
    policy updates each evaluated (0: the initial weights)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in history if "eval/all/pass@1" in r]
    updates = [r["eval/updates"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(updates, [r["eval/all/pass@1"] for r in rows], marker="o", markersize=3, label="pass@1")
    ax.plot(updates, [r["eval/all/mean_reward"] for r in rows], marker="x", markersize=3, label="mean reward")
    ax.set_xlabel("policy updates")
    ax.set_ylim(*value_limits([*(r["eval/all/pass@1"] for r in rows), *(r["eval/all/mean_reward"] for r in rows)]))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("rlbatch: held-out evaluation")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def idle_and_overlap(records: Sequence[RecordDict], seconds: float) -> dict[str, float]:
    """Per role, the step's seconds its busiest rank spent outside its phases (``idle/<role>``);
    with generation and training on different ranks, the seconds they ran at the same time
    (``overlap/generate_train``: how much longer both took, each on its busiest rank, than the step)."""
    busy: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    phase_key: dict[str, str] = {}  # phase -> its key in ``busy`` (made once a step)
    for rec in records:
        rank, took, phase = rec["rank"], float(rec["seconds"]), rec["phase"]
        for name in rec["roles"]:
            busy[name][rank] += took
        busy[phase_key.get(phase) or phase_key.setdefault(phase, f"phase:{phase}")][rank] += took
    out = {f"idle/{role}": max(0.0, seconds - max(by_rank.values())) for role, by_rank in busy.items()
           if not role.startswith("phase:")}
    gen, train = busy.get("phase:generate"), busy.get("phase:train")
    if gen and train and not set(gen) & set(train):
        out["overlap/generate_train"] = max(0.0, max(gen.values()) + max(train.values()) - seconds)
    return out


def timeline(records: Sequence[RecordDict], step_started: float) -> dict[str, float]:
    """Each phase's span on the step's timeline, in seconds from the step's start (wall clock):
    ``at/<phase>/start`` (earliest rank; negative for a generation that ran ahead, during an
    earlier step) and ``at/<phase>/end`` (latest rank)."""
    span: dict[str, list[float]] = {}  # phase -> [earliest start, latest end]
    for rec in records:
        start = rec["started"] - step_started
        end = start + float(rec["seconds"])
        got = span.get(rec["phase"])
        if got is None:
            span[rec["phase"]] = [start, end]
        else:
            got[0], got[1] = min(got[0], start), max(got[1], end)
    out: dict[str, float] = {}
    for phase, (start, end) in span.items():
        out[f"at/{phase}/start"], out[f"at/{phase}/end"] = start, end
    return out


def step_row(step: int, rewards: torch.Tensor, rollouts: Rollouts, stats: dict[str, float],
             phase_seconds: dict[str, float], records: Sequence[RecordDict], seconds: float,
             started: float | None = None) -> Row:
    rlen = [rollouts.response_len[i] for i in rollouts.ids]
    row: Row = {
        "step": step,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "samples": len(rollouts.ids),
        "response_len_mean": sum(rlen) / len(rlen),
        "tokens/generated": sum(rlen),
        "tokens/response_max": max(rlen),
        "tokens/total": sum(rlen) + sum(rollouts.prompt_len[i] for i in rollouts.ids),
        "time/step": seconds,
    }
    if getattr(rollouts, "episodes", None):  # trajectories: turns, env time, ends, tool calls; tokens generated vs observed
        from rlbatch.envs.trajectories import trajectory_stats

        row |= trajectory_stats(rollouts.episodes)
    row |= {f"time/{k}": v for k, v in phase_seconds.items()}
    row |= reduce_records(records)
    row |= idle_and_overlap(records, seconds)
    if started is not None:
        row |= timeline(records, started)
    row |= {f"train/{k}": v for k, v in stats.items()}
    return row
