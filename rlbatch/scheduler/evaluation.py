"""Held-out evaluation between steps: ``eval.every``, ``eval.at_start`` (docs/eval.md).

    python -m rlbatch.launch eval.every=10 eval.at_start=true          # the default experiment
    python -m rlbatch.launch experiment=gsm8k ... eval.every=20 eval.data.name=file eval.data.path=test.parquet

After the weight sync of every ``eval.every``-th step (and of the last one) the inference role
generates for every prompt of ``eval.data`` and the scoring roles score the responses as they
score training's (``data.reward_fn``, routed by data source through ``data.reward_fns``). The
step's metrics row gets ``eval/<data_source>/...`` and ``eval/all/...``: mean reward, pass@1
and pass@k (the unbiased estimator), response length, and ``eval/updates``, the number of policy
updates the evaluated weights have had. ``eval.at_start`` evaluates the initial weights before the
first step into the first step's row (which then holds no post-step evaluation).

Evaluation leaves training as it was: it draws nothing from the training data stream, its
samples have ids of their own (negative: training's count up from 0), its sampling seed is
derived from the policy version alone, and every generation reseeds the inference engine from its
own seed, so a run with evaluation trains exactly as one without. Its phases' times and records
stay out of the step's ``time/...`` and memory metrics (``eval/seconds`` holds its wall time).
A row, with its evaluation, is written once per step before the step's checkpoint: a resumed
run keeps the rows (and evaluations) of the steps it does not repeat and redoes the others'.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from rlbatch.config.schema import RLBatchConfig
from rlbatch.data.source import problems_of, split_holdout
from rlbatch.data.synthetic import Sample
from rlbatch.scheduler.controller import Pipeline, Role
from rlbatch.scheduler.scoring import Scoring

ALL = "all"
"""The key of the metrics over every data source."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct: the chance
    that k of them drawn without replacement hold a correct one, 1 - C(n-c, k) / C(n, k) (Chen et
    al. 2021, "Evaluating Large Language Models Trained on Code"), as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_of(n: int) -> list[int]:
    """The k of pass@k reported for ``n`` samples per prompt: 1, the powers of two below n, and n."""
    return sorted({1, n} | {2**j for j in range(1, n.bit_length()) if 2**j < n})


def eval_metrics(rewards: Sequence[float], sources: Sequence[str], lengths: Sequence[int], n: int,
                 correct_at: float) -> dict[str, float]:
    """``eval/<source>/...`` for each data source and ``eval/all/...``, from the rewards, data
    sources and response lengths of samples in group order (``n`` consecutive samples per prompt).
    A sample is correct when its reward is at least ``correct_at``. Samples without a source count
    in ``all`` only."""
    if n < 1 or len(rewards) % n or not len(rewards) == len(sources) == len(lengths):
        raise ValueError(f"eval_metrics: {len(rewards)} rewards, {len(sources)} sources and {len(lengths)} lengths "
                         f"do not make groups of n={n}")
    groups: dict[str, list[int]] = {ALL: []}
    for g in range(len(rewards) // n):
        groups[ALL].append(g)
        if sources[g * n]:
            groups.setdefault(sources[g * n], []).append(g)
    out: dict[str, float] = {}
    for name, members in groups.items():
        if not members:
            continue
        samples = [g * n + j for g in members for j in range(n)]
        correct = [sum(rewards[g * n + j] >= correct_at for j in range(n)) for g in members]
        key = f"eval/{name}"
        out[f"{key}/mean_reward"] = sum(rewards[i] for i in samples) / len(samples)
        out[f"{key}/response_len_mean"] = sum(lengths[i] for i in samples) / len(samples)
        out[f"{key}/prompts"] = float(len(members))
        for k in ks_of(n):
            out[f"{key}/pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(members)
    return out


def due(step: int, steps: int, every: int, at_start: bool) -> bool:
    """Whether the weights after ``step`` (0-based) are evaluated into its row: every ``every``-th
    step and the last one; never with ``every`` 0, and not step 0 when its row holds the
    evaluation of the initial weights (``at_start``)."""
    if every <= 0 or (step == 0 and at_start):
        return False
    return (step + 1) % every == 0 or step == steps - 1


def eval_seed(seed: int, updates: int) -> int:
    """The sampling seed of the evaluation of the weights after ``updates`` updates: from the run's
    seed and the policy version only, so it repeats on resume and draws nothing from training's."""
    return (int(seed) * 1_000_033 + 7_919 * (updates + 1) + 0x5EED) % 2**31


class Evaluation:
    """The run's held-out evaluation: built by the loop after resume; ``after_step`` returns the
    metrics of a step's row ({} where none is due)."""

    def __init__(self, pipe: Pipeline, cfg: RLBatchConfig, start: int) -> None:
        self.pipe, self.cfg, self.e = pipe, cfg, cfg.eval
        self.enabled = int(self.e.every) > 0 or bool(self.e.at_start)
        self.problems: tuple[Sample, ...] = ()
        self.initial: dict[str, float] = {}
        if not self.enabled:
            return
        if int(self.e.holdout):  # the training data's held-out problems (make_stream leaves them out)
            problems = split_holdout(problems_of(cfg.data, cfg.model), int(self.e.holdout), int(self.e.holdout_seed))[1]
        else:
            problems = problems_of(self.e.data, cfg.model)
        limit = int(self.e.max_prompts)
        self.problems = problems[:limit] if limit else problems
        self.infer = Role(pipe, "actor_infer")
        self.scoring = Scoring(pipe, cfg)
        when = [f"every {int(self.e.every)} steps and after the last"] if int(self.e.every) > 0 else []
        when += ["before the first step"] if self.e.at_start else []
        print(f"evaluation: {len(self.problems)} prompts x {int(self.e.samples_per_prompt)} samples "
              f"(temperature {float(self.e.temperature)}), {' and '.join(when)}", flush=True)
        if self.e.at_start and start == 0:
            self.initial = self.run(0)

    def after_step(self, step: int, updates: int) -> dict[str, float]:
        """The evaluation for ``step``'s row: the initial weights' (step 0 with at_start), or the
        current weights' when due (``due``), else nothing."""
        if step == 0 and self.initial:
            out, self.initial = self.initial, {}
            return out
        if not self.enabled or not due(step, int(self.cfg.steps), int(self.e.every), bool(self.e.at_start)):
            return {}
        return self.run(updates)

    def run(self, updates: int) -> dict[str, float]:
        """Generate and score the held-out set with the inference role's current weights (``updates``:
        the policy version they hold). Its phases' records and times are kept out of the step's."""
        pipe, n = self.pipe, int(self.e.samples_per_prompt)
        t0 = time.perf_counter()
        records, seconds = pipe.records, pipe.phase_seconds
        pipe.records, pipe.phase_seconds = [], {}
        try:
            total = len(self.problems) * n
            override = {"temperature": float(self.e.temperature)}
            ro = self.infer.start_generate(list(self.problems), n, first_id=-total, seed=eval_seed(int(self.cfg.seed), updates),
                                           version=updates, override=override).result()
            self.scoring.start(ro)
            rewards, _ = self.scoring.result()
            pipe.forget(ro.ids)
        finally:
            pipe.records, pipe.phase_seconds = records, seconds
        sources = ro.sources or [""] * total
        lengths = [ro.response_len[i] for i in ro.ids]
        return eval_metrics(rewards.tolist(), sources, lengths, n, float(self.e.correct_at)) | {
            "eval/updates": float(updates), "eval/seconds": time.perf_counter() - t0}
