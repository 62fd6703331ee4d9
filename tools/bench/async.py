"""Asynchronous against synchronous training on the same disaggregated placement, in one run.

    python tools/bench/async.py [--steps 40] [--staleness 1,2] [--infer vllm:d1] [--out .bench-runs/async]
    python tools/bench/async.py --in-flight [--workload long-tail]   # sync vs async vs async + in-flight updates

The placement is ``roles=disaggregated``: actor_train on one rank, actor_infer on another, the
reward on a CPU worker, and the reference (``--reference``) on the inference rank, where
asynchronously its log-probs of each generation are taken right after it, or on the trainer's. Each setting is one launch of the default
task with vLLM rollouts of a wider random-initialised Qwen2 (``--hidden``/``--layers``: the
default ~4M parameters, head_dim 64) and longer responses, so that generation and training
take comparable time: first ``algo.max_staleness=0`` (the synchronous loop), then each staleness
in ``--staleness`` with truncated importance sampling. Launches alternate over ``--repeats``.

Throughput is samples/s over the steps after the first ``--warmup`` (start-up and the first
step's compilation are kept out). The reward is followed too: the step at which the mean over
3 consecutive steps first reaches ``--threshold`` (by samples, for each setting), so a speed-up
that learns slower is visible. Writes results.json and timeline.png (each setting's per-step
phase seconds: generation on the inference rank against training on the trainer) under
--out, and ends with one line: ``async speedup: N.NNx`` (staleness 1 against synchronous).

``--in-flight`` compares three settings in one run: synchronous, asynchronous (staleness 1) and
asynchronous with weights landing mid-generation and partial rollouts (``algo.in_flight_updates=true
algo.partial_rollouts=true``, staleness 2: a step's batch is the first groups to finish, long
samples go on into later steps' batches), all on the same placement, and ends with ``in-flight
speedup: N.NNx`` (against synchronous), after the same figure against asynchronous.

``--workload long-tail``: a generation-bound workload that learns. The default task (addition
modulo 10) on the default experiment's small model (64 wide, 2 layers; 2 heads and 1 KV head, as
vLLM's CPU attention needs), up to ``--long-tail-tokens`` (256) new tokens, 8 prompts × 16 samples
a step (``--prompts``/``--samples``), and the reward ``leading_number_match`` (1.0 when the
response starts with the answer's number, whatever follows), so that the policy learns while its
responses stay long, as a reasoning-style response would. The random-initialised policy stops at
its end-of-sequence token about once in the vocabulary's 18 tokens, so response lengths are about
geometric: most samples end within a few dozen tokens and a few run several times longer, and a
synchronous step's generation waits for its longest, one engine step per token, while training
the small model is cheap. The reward starts near 0.02 and rises slowly (about 0.08 by step 100 of
128 samples), so ``--threshold`` defaults to 0.1 here. Nothing holds the length after the answer,
so it drifts, differently in each setting: the table reports each setting's median mean and
longest response (``len``, ``max``), so the tail and the drift are visible (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LONG_TAIL_REWARD = "rlbatch.rewards.rules:leading_number_match"
"""The long-tail workload's reward: the answer's number first, whatever follows (learnable while
responses stay long)."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the throughput")
    p.add_argument("--staleness", default="1,2", help="comma-separated max_staleness values besides 0")
    p.add_argument("--infer", default="vllm:d1", help="actor_infer's backend (its one rank)")
    p.add_argument("--reference", choices=("inference", "trainer"), default="inference",
                   help="the reference's rank: actor_infer's (asynchronously its log-probs follow each "
                        "generation there) or actor_train's")
    p.add_argument("--hidden", type=int, default=None, help="the model's width (256; long-tail: 64)")
    p.add_argument("--layers", type=int, default=None, help="(4; long-tail: 2)")
    p.add_argument("--heads", type=int, default=None, help="(4; long-tail: 2)")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (16; long-tail: 8)")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt (8; long-tail: 16)")
    p.add_argument("--threshold", type=float, default=None,
                   help="the reward the 3-step mean must reach (0.8; long-tail: 0.1)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / ".bench-runs" / "async")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override for every launch")
    p.add_argument("--workload", choices=("default", "long-tail"), default="default",
                   help="long-tail: up to --long-tail-tokens new tokens, lengths about geometric (a few samples "
                        "much longer than the rest)")
    p.add_argument("--long-tail-tokens", type=int, default=256)
    p.add_argument("--in-flight", action="store_true",
                   help="compare synchronous, asynchronous and asynchronous with in-flight weight updates")
    a = p.parse_args()
    long_tail = a.workload == "long-tail"
    if long_tail:
        a.max_new_tokens = a.long_tail_tokens
    for name, default, long in (("hidden", 256, 64), ("layers", 4, 2), ("heads", 4, 2), ("prompts", 16, 8),
                                 ("samples", 8, 16), ("threshold", 0.8, 0.1)):
        if getattr(a, name) is None:
            setattr(a, name, long if long_tail else default)
    return a


Setting = tuple[str, int, list[str]]
"""A launch of the comparison: its name, its max_staleness and its own overrides."""


def settings_of(a: argparse.Namespace) -> list[Setting]:
    """The settings compared: synchronous and each staleness, or with ``--in-flight`` synchronous,
    asynchronous (staleness 1) and asynchronous with in-flight updates and partial rollouts
    (staleness 2: one step's generation ahead, and one more step a long sample may stay in flight)."""
    if a.in_flight:
        return [("sync", 0, []), ("async", 1, []),
                ("async+in-flight", 2, ["algo.in_flight_updates=true", "algo.partial_rollouts=true"])]
    return [(f"max_staleness={k}", k, []) for k in [0, *(int(x) for x in a.staleness.split(",") if x)]]


def overrides(a: argparse.Namespace, staleness: int) -> list[str]:
    out = ["roles=disaggregated", f"roles.actor_infer.backend={a.infer}",
           f"roles.reference.device_mapping=[{1 if a.reference == 'inference' else 0}]", f"steps={a.steps}",
           f"model.hidden_size={a.hidden}", f"model.intermediate_size={4 * a.hidden}", f"model.num_layers={a.layers}",
           f"model.num_heads={a.heads}", f"model.num_kv_heads={a.kv_heads}", f"model.max_position_embeddings={max(128, 64 + a.max_new_tokens)}",
           f"algo.max_new_tokens={a.max_new_tokens}", f"algo.prompts_per_step={a.prompts}",
           f"algo.samples_per_prompt={a.samples}", f"algo.max_staleness={staleness}",
           *([f"data.reward_fn={LONG_TAIL_REWARD}"] if a.workload == "long-tail" else []), *a.override]
    return out + (["algo.off_policy=tis"] if staleness else [])


def launch(a: argparse.Namespace, staleness: int, run_dir: Path, extra: list[str] | None = None) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "rlbatch.launch", *overrides(a, staleness), *(extra or []), f"run_dir={run_dir}",
           "resume=never"]
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                   stdout=subprocess.DEVNULL)
    print(f"  {time.perf_counter() - start:.0f}s", flush=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict[str, Any]], warmup: int, threshold: float) -> dict[str, Any]:
    timed = rows[warmup:]
    seconds = sum(r["time/step"] for r in timed)
    samples = sum(r["samples"] for r in timed)
    reward = [r["reward_mean"] for r in rows]
    reached = next((k for k in range(2, len(reward)) if sum(reward[k - 2 : k + 1]) / 3 >= threshold), None)
    med = {k: statistics.median(r.get(k, 0.0) for r in timed)
           for k in ("time/step", "time/generate", "time/ref_logprobs", "time/train", "overlap/generate_train",
                     "idle/actor_infer", "idle/actor_train", "response_len_mean", "tokens/response_max",
                     "train/mixed_version_frac")}
    return {"samples_per_s": samples / seconds, "median": med, "reward_first": reward[0], "reward_last": reward[-1],
            "reached_step": reached, "stale_dropped": sum(r.get("train/stale_dropped", 0.0) for r in rows),
            "reached_samples": None if reached is None else sum(r["samples"] for r in rows[: reached + 1]),
            "staleness": sorted({r.get("train/staleness", 0.0) for r in rows})}


def plot(results: dict[str, list[list[dict[str, Any]]]], path: Path, reference_row: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no timeline.png", flush=True)
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.2 * len(results)), dpi=110, sharex=True)
    axes = list(axes) if len(results) > 1 else [axes]
    for ax, (name, runs) in zip(axes, results.items(), strict=True):
        rows = runs[0][1:13]  # steps 1..12 (step 0 includes start-up)
        t = 0.0
        for r in rows:
            for y, phase, color in ((1, "generate", "tab:blue"), (reference_row, "ref_logprobs", "tab:green"),
                                    (0, "old_logprobs", "tab:olive"), (0, "train", "tab:orange")):
                if f"at/{phase}/start" in r:
                    start, end = r[f"at/{phase}/start"], r[f"at/{phase}/end"]
                    ax.barh(y, end - start, left=t + start, color=color)
            t += r["time/step"]
            ax.axvline(t, color="grey", lw=0.5)
        ax.set_yticks([0, 1], ["trainer", "inference"])
        ax.set_title(name, fontsize=9)
    axes[-1].set_xlabel("seconds from the start of step 1 (wall clock; blue: generate, green: reference and old "
                        "log-probs, orange: train; grey lines: step ends)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    a = parse()
    a.out.mkdir(parents=True, exist_ok=True)
    settings = settings_of(a)
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name, _, _ in settings}
    for rep in range(a.repeats):
        for name, k, extra in settings:
            tag = name.replace("max_staleness=", "k").replace("+", "-")
            runs[name].append(launch(a, k, a.out / f"{tag}-r{rep}", extra))
    results = {}
    for name, reps in runs.items():
        each = [summary(rows, a.warmup, a.threshold) for rows in reps]
        results[name] = {"runs": each, "samples_per_s": statistics.median(e["samples_per_s"] for e in each)}
    print(f"\nworkload ({a.workload}): {' '.join(overrides(a, 0))}  (samples/s over steps {a.warmup}..{a.steps - 1}, "
          f"median of {a.repeats} launch(es) per setting)")
    print(f"{'setting':18} {'samples/s':>9} {'step s':>7} {'gen s':>6} {'ref s':>6} {'train s':>7} {'overlap':>7} "
          f"{'idle inf':>8} {'idle trn':>8} {'len':>5} {'max':>4} {'mixed':>5} {'drop':>4} {'reward':>13} "
          f"{f'>= {a.threshold} at':>14} staleness")
    for name, res in results.items():
        e = res["runs"][0]
        m = e["median"]
        at = "-" if e["reached_step"] is None else f"step {e['reached_step']} ({e['reached_samples']})"
        print(f"{name:18} {res['samples_per_s']:9.1f} {m['time/step']:7.2f} {m['time/generate']:6.2f} "
              f"{m['time/ref_logprobs']:6.2f} "
              f"{m['time/train']:7.2f} {m['overlap/generate_train']:7.2f} {m['idle/actor_infer']:8.2f} "
              f"{m['idle/actor_train']:8.2f} {m['response_len_mean']:5.1f} {m['tokens/response_max']:4.0f} "
              f"{m['train/mixed_version_frac']:5.2f} {e['stale_dropped']:4.0f} "
              f"{e['reward_first']:5.2f} -> {e['reward_last']:4.2f} {at:>14} {e['staleness']}")
    (a.out / "results.json").write_text(json.dumps({"workload": overrides(a, 0), "settings": settings,
                                                    "results": results}, indent=1))
    plot(runs, a.out / "timeline.png", 1 if a.reference == "inference" else 0)
    base = results[settings[0][0]]["samples_per_s"]
    if a.in_flight:
        fast = results["async+in-flight"]["samples_per_s"]
        print(f"async: {results['async']['samples_per_s'] / base:.2f}x synchronous")
        print(f"in-flight vs async: {fast / results['async']['samples_per_s']:.2f}x")
        print(f"in-flight speedup: {fast / base:.2f}x")
        return
    for name, _, _ in settings[1:]:
        print(f"{name}: {results[name]['samples_per_s'] / base:.2f}x synchronous")
    if "max_staleness=1" in results:
        print(f"async speedup: {results['max_staleness=1']['samples_per_s'] / base:.2f}x")


if __name__ == "__main__":
    main()
