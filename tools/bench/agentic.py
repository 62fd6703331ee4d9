"""Multi-turn rollouts scheduled per trajectory against the turn barrier, on one workload, in one run.

    python tools/bench/agentic.py [--trajectories 64] [--slow 0.1] [--delay 0.3] [--repeats 3]

The workload: running_sum trajectories of uneven length (1 to 5 turns, drawn per trajectory) played
by the hf engine (the tiny default model, random-initialised, on this machine's CPU, its ``Turns``
batching whatever is pending at each poll: ``rlbatch.engines.base.BatchedTurns``), through the same
``MultiTurn`` the generate phase uses. Each env step takes 5 ms, and a ``--slow`` share of them
``--delay`` seconds (an env calling out to something slow). The same trajectories (same tasks and
seeds) run with ``Rollout(barrier=False)``, each trajectory going on as soon as its env answers, and
``barrier=True``, every trajectory's turn, then every env step, then the next turn (what a
batch-synchronous loop does). Prints each schedule's trajectories/s (median over ``--repeats``),
the generated tokens, and ``agentic speedup: N.NNx`` (per-trajectory over barrier).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--slow", type=float, default=0.1, help="share of env steps that are slow")
    ap.add_argument("--delay", type=float, default=0.3, help="seconds a slow env step takes")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from rlbatch.config.plain import to_plain
    from rlbatch.engines.base import EngineContext, SamplingParams
    from rlbatch.engines.infer.hf import HFInferenceEngine
    from rlbatch.engines.model import load_tokenizer
    from rlbatch.engines.registry import HFArgs
    from rlbatch.envs.registry import register_env
    from rlbatch.envs.trajectories import MultiTurn, episode_seed
    from rlbatch.launch.compose import compose

    register_env("bench_slow_sum", SlowSum)
    cfg = compose(["experiment=multiturn"])
    plain = to_plain(cfg)
    plain["env"] |= {"name": "bench_slow_sum", "max_turns": 5, "args": {"slow": args.slow, "delay": args.delay}}
    torch.set_num_threads(1)
    tok = load_tokenizer(cfg.model)
    engine = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, torch.device("cpu"), seed=1))
    prompt = list(tok("")["input_ids"])
    n = args.trajectories
    seeds = [episode_seed(1, g) for g in range(n)]
    params = SamplingParams(1, temperature=1.0)
    rates: dict[str, list[float]] = {"per-trajectory": [], "turn-barrier": []}
    tokens: dict[str, int] = {}
    for rep in range(args.repeats):
        for name, barrier in (("per-trajectory", False), ("turn-barrier", True)):
            rollout = MultiTurn(plain, tok, barrier=barrier)
            start = time.perf_counter()
            done = rollout(engine, [prompt] * n, params, [{}] * n, seeds, seed=rep)
            seconds = time.perf_counter() - start
            rates[name].append(n / seconds)
            tokens[name] = sum(t.generated for t in done)
            turns = sorted(t.turns for t in done)
            print(f"  {name:15s} repeat {rep}: {seconds:6.2f} s, {n / seconds:6.1f} trajectories/s, "
                  f"turns {turns[0]}-{turns[-1]} (mean {sum(turns) / n:.2f})", flush=True)
    per, bar = statistics.median(rates["per-trajectory"]), statistics.median(rates["turn-barrier"])
    print(f"workload: {n} trajectories of 1-5 turns, {args.slow:.0%} of env steps {args.delay} s (else 5 ms), "
          f"hf engine (tiny model) on CPU, medians of {args.repeats}")
    print(f"per-trajectory: {per:.1f} trajectories/s ({tokens['per-trajectory']} tokens generated)")
    print(f"turn-barrier:   {bar:.1f} trajectories/s ({tokens['turn-barrier']} tokens generated)")
    print(f"agentic speedup: {per / bar:.2f}x")


if __name__ == "__main__":
    main()
