"""Multi-turn rollouts scheduled per trajectory against the turn barrier, on one workload, in one run.

    python tools/bench/agentic.py [--trajectories 64] [--slow 0.1] [--delay 0.3] [--repeats 3]
                                  [--max-new-tokens 1] [--engine hf|vllm] [--plot docs/agentic_timeline.png]

The workload: running_sum trajectories of uneven length (1 to 5 turns, drawn per trajectory) played
by the hf engine (the tiny default model, random-initialised, on this machine's CPU, its ``Turns``
batching whatever is pending at each poll: ``rlbatch.engines.base.BatchedTurns``) or with
``--engine vllm`` the vllm engine (its CPU build; the model with 2 attention heads, as vLLM's CPU
attention needs; requests join and leave its running batch), through the same ``MultiTurn`` the
generate phase uses. Each env step takes 5 ms, and a ``--slow`` share of them
``--delay`` seconds (an env calling out to something slow). With ``--max-new-tokens N`` > 1 each
turn's length is drawn too, from a long tail (Pareto, alpha 1.5, mean about N / 4, capped at N; from
the request's seed, so both schedules draw the same): turns generate up to their own cap, as real
turns end at their own EOS. The same trajectories (same tasks and
seeds) run with ``Rollout(barrier=False)``, each trajectory going on as soon as its env answers, and
``barrier=True``, every trajectory's turn, then every env step, then the next turn (what a
batch-synchronous loop does). After one untimed round of each, prints each schedule's
trajectories/s (median over ``--repeats``),
the generated tokens, and ``agentic speedup: N.NNx`` (per-trajectory over barrier). ``--plot``:
the last repeat's timelines, one lane per trajectory (with the engine, then its env), both schedules.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class SlowSum:
    """running_sum whose length is drawn from the seed (1 to 5 turns) and whose steps are slow now
    and then (drawn from the seed and the turn, so both schedules see the same delays)."""

    def __init__(self, slow: float = 0.1, delay: float = 0.3) -> None:
        from rlbatch.envs.running_sum import RunningSum

        self.slow, self.delay, self.seed = slow, delay, 0
        self.inner: Any = RunningSum
        self.env: Any = None

    def reset(self, task: Any, seed: int) -> str:
        self.seed = seed
        self.env = self.inner(turns=random.Random(seed).randint(1, 5))
        return str(self.env.reset({}, seed))

    def step(self, action: str) -> Any:
        rng = random.Random(self.seed * 1000 + self.env.turn)
        time.sleep(self.delay if rng.random() < self.slow else 0.005)
        return self.env.step(action)


class TailTurns:
    """``Turns`` whose requests each generate up to their own cap: drawn from a long tail (Pareto,
    alpha 1.5, scaled to a mean of about ``cap / 4``, at most ``cap``) by the request's seed."""

    def __init__(self, inner: Any, cap: int) -> None:
        self.inner, self.cap = inner, cap

    def length(self, seed: int) -> int:
        return max(1, min(self.cap, int(random.Random(seed).paretovariate(1.5) * self.cap / 12)))

    def submit(self, requests: list[Any], params: Any) -> None:
        import dataclasses

        for r in requests:
            self.inner.submit([r], dataclasses.replace(params, max_new_tokens=self.length(r.seed)))

    def poll(self, block: bool = True) -> list[Any]:
        return list(self.inner.poll(block))

    def in_flight(self) -> int:
        return int(self.inner.in_flight())


def plot(timelines: dict[str, list[tuple[float, int, str]]], path: str) -> None:
    """One lane per trajectory and schedule: blue while its turn is with the engine (from its env's
    answer to the turn's last token), orange from there to its env's answer being taken up (its env
    stepping, and under the barrier the wait for every other trajectory's turn and step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(timelines), figsize=(6 * len(timelines), 5), sharex=True, sharey=True)
    for ax, (name, events) in zip(axes, timelines.items(), strict=True):
        last: dict[int, tuple[float, str]] = {}
        for t, key, what in sorted(events):
            t0, before = last.get(key, (0.0, "generated"))  # the episode's start is an env call
            color = "tab:orange" if before == "generated" else "tab:blue"
            ax.broken_barh([(t0, t - t0)], (key - 0.4, 0.8), color=color, linewidth=0)
            last[key] = (t, what)
        ax.set_title(f"{name}: done at {max(t for t, _, _ in events):.2f} s")
        ax.set_xlabel("seconds")
    axes[0].set_ylabel("trajectory")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="tab:blue"), plt.Rectangle((0, 0), 1, 1, color="tab:orange")],
               labels=["with the engine (queued, generating)", "its env stepping, or (barrier) waiting for the others"],
               loc="lower center", ncol=2)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=100)
    print(f"timeline: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--slow", type=float, default=0.1, help="share of env steps that are slow")
    ap.add_argument("--delay", type=float, default=0.3, help="seconds a slow env step takes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=1,
                    help="> 1: each turn's cap drawn from a long tail with a mean of about a quarter of it")
    ap.add_argument("--plot", default="", help="write the last repeat's timelines to this PNG")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    args = ap.parse_args()

    import torch

    from rlbatch.config.compose import compose
    from rlbatch.config.parse import parsed
    from rlbatch.config.plain import to_plain
    from rlbatch.engines.base import EngineContext, SamplingParams, build_engine, turns_of
    from rlbatch.engines.hf import HFArgs
    from rlbatch.engines.model import load_tokenizer
    from rlbatch.engines.vllm import VLLMArgs
    from rlbatch.envs.registry import register_env
    from rlbatch.envs.trajectories import MultiTurn, episode_seed

    register_env("bench_slow_sum", SlowSum)
    cfg = compose(["experiment=multiturn", *(["model.num_heads=2", "model.num_kv_heads=1"] if args.engine == "vllm" else [])])
    plain = to_plain(cfg)
    plain["env"] |= {"name": "bench_slow_sum", "max_turns": 5, "args": {"slow": args.slow, "delay": args.delay}}
    typed = parsed(plain)
    torch.set_num_threads(1)
    tok = load_tokenizer(cfg.model)
    engine_args = HFArgs() if args.engine == "hf" else VLLMArgs(kv_cache_mb=256, dtype="fp32")
    engine = build_engine(args.engine, EngineContext("actor_infer", engine_args, cfg.model, cfg.algo, tok,
                                                     torch.device("cpu"), seed=1))
    prompt = list(tok("")["input_ids"])
    n = args.trajectories
    seeds = [episode_seed(1, g) for g in range(n)]
    params = SamplingParams(args.max_new_tokens, temperature=1.0)
    generator = TailTurns(turns_of(engine), args.max_new_tokens) if args.max_new_tokens > 1 else engine
    timelines: dict[str, list[tuple[float, int, str]]] = {}
    rates: dict[str, list[float]] = {"per-trajectory": [], "turn-barrier": []}
    tokens: dict[str, int] = {}
    for barrier in (False, True):  # untimed: the engine's first calls (vLLM warms up its kernels)
        MultiTurn(typed, tok, barrier=barrier)(generator, [prompt] * n, params, [{}] * n, seeds, seed=-1)
    for rep in range(args.repeats):
        for name, barrier in (("per-trajectory", False), ("turn-barrier", True)):
            rollout = MultiTurn(typed, tok, barrier=barrier)
            start = time.perf_counter()
            done = rollout(generator, [prompt] * n, params, [{}] * n, seeds, seed=rep)
            seconds = time.perf_counter() - start
            assert rollout.last is not None
            timelines[name] = rollout.last.timeline
            rates[name].append(n / seconds)
            tokens[name] = sum(t.generated for t in done)
            turns = sorted(t.turns for t in done)
            print(f"  {name:15s} repeat {rep}: {seconds:6.2f} s, {n / seconds:6.1f} trajectories/s, "
                  f"turns {turns[0]}-{turns[-1]} (mean {sum(turns) / n:.2f})", flush=True)
    per, bar = statistics.median(rates["per-trajectory"]), statistics.median(rates["turn-barrier"])
    lengths = (f"turns of up to {args.max_new_tokens} tokens (long tail, mean ~{args.max_new_tokens / 4:g})"
               if args.max_new_tokens > 1 else "one token a turn")
    print(f"workload: {n} trajectories of 1-5 turns, {lengths}, {args.slow:.0%} of env steps {args.delay} s "
          f"(else 5 ms), {args.engine} engine (tiny model) on CPU, medians of {args.repeats}")
    print(f"per-trajectory: {per:.1f} trajectories/s ({tokens['per-trajectory']} tokens generated)")
    print(f"turn-barrier:   {bar:.1f} trajectories/s ({tokens['turn-barrier']} tokens generated)")
    print(f"agentic speedup: {per / bar:.2f}x")
    if args.plot:
        plot(timelines, args.plot)


if __name__ == "__main__":
    main()
