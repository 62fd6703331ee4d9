"""Held-out evaluation during training: ``eval.every``, ``eval.at_start`` (docs/eval.md).

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
stay out of the step's ``time/...`` and memory metrics (``eval/seconds`` holds their time), in a
ledger of their own (``Pipeline.apart``).

Where the inference and scoring roles have ranks of their own, an evaluation runs alongside the
next step's training instead of between steps (``Evaluation``; ``eval/overlapped`` says which,
``eval/overlap_seconds`` how long it ran beside training phases). A row, with its evaluation, is
written once per step, in step order, before the step's checkpoint: a resumed run keeps the rows
(and evaluations) of the steps it does not repeat and redoes the others'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from rlbatch.config.schema import RLBatchConfig
from rlbatch.data.prompt_length import PromptCounts
from rlbatch.data.source import guarded_problems, split_holdout
from rlbatch.data.synthetic import Sample
from rlbatch.loop.controller import Ledger, PendingRollouts, Pipeline, Role
from rlbatch.loop.metrics import Row
from rlbatch.loop.residency import RecordDict
from rlbatch.loop.scoring import Scoring

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


def alongside_others(members: Mapping[str, Collection[int]], own: Collection[str]) -> bool:
    """Whether the roles ``own`` (evaluation's: the inference and scoring roles) have ranks of their
    own: no other role of ``members`` (role -> its ranks) is on any of them, so evaluation's phases
    can run while the other roles' run."""
    mine = {r for name in own for r in members.get(name, ())}
    return not any(mine & set(ranks) for name, ranks in members.items() if name not in own)


def spans(records: Sequence[RecordDict]) -> list[tuple[float, float]]:
    """The wall-clock intervals the phases of ``records`` covered (``started``, ``seconds``),
    overlapping ones merged, in order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((float(r["started"]), float(r["started"]) + float(r["seconds"])) for r in records):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap_seconds(evaluation: Sequence[RecordDict], step: Sequence[RecordDict],
                    own: Collection[str]) -> float:
    """Seconds during which a phase of ``evaluation`` (its per-rank records) and a phase of the
    step (``step``'s records) that none of the roles ``own`` works in ran at the same time: the
    training phases evaluation ran alongside. A phase of an evaluation role (the step's generation,
    scoring, the weight sync) does not count: evaluation queues behind it or it behind evaluation."""
    others = spans([r for r in step if not set(r["roles"]) & set(own)])
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans(evaluation) for c, d in others)


@dataclass
class Pending:
    """An evaluation of the weights after ``updates`` updates whose row is not written yet."""

    updates: int
    row: Row | None = None
    """The metrics row it goes into, held until it is done (None: the row of the step under way)."""
    gen: PendingRollouts | None = None
    scored: bool = False
    overlapped: bool = False
    """Its generation was queued behind a step's training generation, alongside the training."""
    ledger: Ledger = field(default_factory=Ledger)
    """Its phases' records and seconds, apart from every step's."""


class Evaluation:
    """The run's held-out evaluation, built by the loop after resume.

    The loop tells it where a step is: ``behind`` for what to queue behind a step's generation on
    the inference ranks, ``before_sync`` before the weight sync, and at the end of the step
    ``finished`` (rows held for an evaluation done now), ``after_step`` (the metrics for the row)
    and ``hold`` (whether the row waits for an evaluation that runs alongside the next step).

    Where the inference and scoring roles have ranks of their own (``alongside_others``), an
    evaluation due after step s's sync runs during step s+1: its generation is queued on the
    inference ranks behind step s+1's (the trainer waits for that one, not for evaluation's), once
    the step's samples are on their way off them (``GenerationQueue.take``), so it runs while the
    trainer computes log-probs and trains, and before step s+1's sync changes the weights (the
    inference ranks run their commands in order); it is scored before that sync, and step s's row,
    held until then, is written at the end of step s+1, before step s+1's. A step whose checkpoint
    is saved (``save_every``, the last step, a stop) is evaluated before its checkpoint, between
    steps, as on a placement that shares the inference ranks: a checkpoint never precedes the rows
    of its steps."""

    def __init__(self, pipe: Pipeline, cfg: RLBatchConfig, start: int, standalone: bool = False) -> None:
        """``standalone``: no training around it (``program=eval``, ``rlbatch.loop.evaluate_only``):
        the held-out set is read whatever ``eval.every`` and ``eval.at_start`` say, and only ``run``
        is called."""
        self.pipe, self.cfg, self.e = pipe, cfg, cfg.eval
        self.enabled = standalone or int(self.e.every) > 0 or bool(self.e.at_start)
        self.problems: tuple[Sample, ...] = ()
        self.prompt_counts = PromptCounts()
        """What the prompt-length guard did to the held-out set (``eval.data.max_prompt_tokens``)."""
        self.pending: Pending | None = None
        self.initial: dict[str, float] = {}
        self.overlaps = False
        if not self.enabled:
            return
        if int(self.e.holdout):  # the training data's held-out problems (make_stream leaves them out)
            guarded, _ = guarded_problems(cfg.data, cfg.model)
            problems = split_holdout(guarded, int(self.e.holdout), int(self.e.holdout_seed))[1]
        else:
            problems, self.prompt_counts = guarded_problems(self.e.data, cfg.model, "eval.data")
        limit = int(self.e.max_prompts)
        self.problems = problems[:limit] if limit else problems
        self.infer = Role(pipe, "actor_infer")
        self.scoring = Scoring(pipe, cfg)
        self.roles = (self.infer.name, *(role.name for role, _ in self.scoring.roles))
        self.overlaps = alongside_others({r: pipe.world.members.get(r, ()) for r in pipe.p.roles}, self.roles)
        what = (f"evaluation: {len(self.problems)} prompts x {int(self.e.samples_per_prompt)} samples "
                f"(temperature {float(self.e.temperature)})")
        if standalone:
            print(what, flush=True)
            return
        when = [f"every {int(self.e.every)} steps and after the last"] if int(self.e.every) > 0 else []
        when += ["before the first step"] if self.e.at_start else []
        where = ("alongside the next step's training (the inference and scoring ranks are their own)" if self.overlaps
                 else "between steps (the inference or scoring ranks are shared with training)")
        print(f"{what}, {' and '.join(when)}, {where}", flush=True)
        if self.e.at_start and start == 0:  # the initial weights, into step 0's row: alongside step 0, or now
            if self.overlaps:
                self.pending = Pending(0)
            else:
                self.initial = self.run(0)

    # --- the loop's hooks ---------------------------------------------------------------------------

    def behind(self) -> Callable[[], None] | None:
        """What waits to be queued on the inference ranks behind a step's generation: the
        generation of an evaluation not started yet (None: nothing)."""
        waiting = self.pending
        if waiting is None or waiting.gen is not None:
            return None
        return lambda: self._generate(waiting, overlapped=True)

    def before_sync(self) -> None:
        """The weights are about to change: a waiting evaluation is generated (now, if it was not
        queued yet) and its scoring started."""
        if self.pending is not None:
            if self.pending.gen is None:
                self._generate(self.pending, overlapped=False)
            self._score(self.pending)

    def finished(self, records: list[RecordDict]) -> list[Row]:
        """At the end of a step (``records``: its phases'): the row held for an evaluation that ran
        alongside it, now complete (none, or one)."""
        held = self.pending
        if held is None or held.row is None:
            return []
        self.pending = None
        return [held.row | self._result(held, records)]

    def after_step(self, step: int, updates: int, records: list[RecordDict], defer: bool) -> dict[str, float]:
        """The evaluation for ``step``'s row: the initial weights' (step 0 with at_start), or the
        current weights' when due (``due``), else nothing. ``defer``: the row may wait, so a due
        evaluation is left for the next step to run alongside (``hold``) where the placement allows."""
        if step == 0 and self.initial:
            out, self.initial = self.initial, {}
            return out
        if step == 0 and self.pending is not None:  # the initial weights', run alongside step 0
            initial, self.pending = self.pending, None
            return self._result(initial, records)
        if not self.enabled or not due(step, int(self.cfg.steps), int(self.e.every), bool(self.e.at_start)):
            return {}
        if defer and self.overlaps:
            self.pending = Pending(updates)
            return {}
        return self.run(updates)

    def hold(self, row: Row, now: bool) -> Row | None:
        """``row`` as it is to be written, or None when it waits for the evaluation ``after_step``
        left for the next step; ``now``: the run stops here, so that evaluation runs now instead."""
        wait = self.pending
        if wait is None or wait.row is not None or wait.gen is not None:
            return row
        if now:
            self.pending = None
            return row | self._result(wait, self.pipe.records)
        wait.row = row
        return None

    # --- one evaluation ------------------------------------------------------------------------------

    def run(self, updates: int) -> dict[str, float]:
        """Generate and score the held-out set with the inference role's current weights (``updates``:
        the policy version they hold), and wait for it."""
        return self._result(Pending(updates), self.pipe.records)

    @contextmanager
    def _apart(self, pending: Pending) -> Iterator[None]:
        """Phases started meanwhile keep their records and times in ``pending``'s ledger, out of the
        step's (``time/...``, memory and host metrics), whenever they finish."""
        self.pipe.apart = pending.ledger
        try:
            yield
        finally:
            self.pipe.apart = None

    def _generate(self, p: Pending, overlapped: bool) -> None:
        total = len(self.problems) * int(self.e.samples_per_prompt)
        with self._apart(p):
            p.gen = self.infer.start_generate(list(self.problems), int(self.e.samples_per_prompt), first_id=-total,
                                              seed=eval_seed(int(self.cfg.seed), p.updates), version=p.updates,
                                              override={"temperature": float(self.e.temperature)})
        p.overlapped = overlapped

    def _score(self, p: Pending) -> None:
        assert p.gen is not None
        if not p.scored:
            ro = p.gen.result()
            with self._apart(p):
                self.scoring.start(ro)
            p.scored = True

    def _result(self, p: Pending, records: list[RecordDict]) -> dict[str, float]:
        """Wait for ``p`` (generating and scoring it first if that has not started) and return its
        metrics; ``records``: those of the step it ran in, for ``eval/overlap_seconds``."""
        if p.gen is None:
            self._generate(p, overlapped=False)
        self._score(p)
        assert p.gen is not None
        ro = p.gen.result()
        rewards, _ = self.scoring.result()
        self.pipe.forget(ro.ids)
        n = int(self.e.samples_per_prompt)
        sources = ro.sources or [""] * len(ro.ids)
        lengths = [ro.response_len[i] for i in ro.ids]
        return eval_metrics(rewards.tolist(), sources, lengths, n, float(self.e.correct_at)) | {
            "eval/updates": float(p.updates), "eval/seconds": sum(p.ledger.phase_seconds.values()),
            "eval/overlapped": float(p.overlapped),
            "eval/overlap_seconds": overlap_seconds(p.ledger.records, records, self.roles)
        } | self.prompt_counts.metrics("eval/data")
