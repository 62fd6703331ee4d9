"""Rewards from running responses against their problem's tests in the sandbox (the ``code_sandbox`` role).

Each response becomes one execution: the problem's ``prefix`` followed by the code extracted from
the response (before its stop marker; a fenced block if it has one), then each test. The reward
is the fraction of tests passed (``sandbox.scoring=fraction``) or 1 only when all pass (``all``).
Outcomes are cached by program and tests (``sandbox.cache``): a policy repeats its answers, and a
deterministic program's outcome does not change.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlbatch.config.limits import Limits
from rlbatch.data.code import decode_tests, extract_code
from rlbatch.rewards.rules import split_at_stop
from rlbatch.sandbox.runner import Job, Outcome, Sandbox

if TYPE_CHECKING:
    from rlbatch.config.schema import RLBatchConfig, SandboxConfig

log = logging.getLogger(__name__)


class CodeScorer:
    def __init__(self, sandbox_cfg: SandboxConfig) -> None:
        given = sandbox_cfg.limits
        limits = given if isinstance(given, Limits) else Limits(**dict(given))
        self.sandbox = Sandbox(limits, str(sandbox_cfg.isolation), int(sandbox_cfg.workers))
        self.all_or_nothing = str(sandbox_cfg.scoring) == "all"
        self.cache: OrderedDict[tuple[str, tuple[str, ...]], Outcome] | None = (
            OrderedDict() if int(sandbox_cfg.cache) > 0 else None)
        self.cache_size = int(sandbox_cfg.cache)
        log.info("code sandbox: isolation %s, %d parallel executions, scoring %s", self.sandbox.mode,
                 self.sandbox.workers, sandbox_cfg.scoring)

    def reward(self, outcome: Outcome) -> float:
        if self.all_or_nothing:
            return 1.0 if outcome.total and outcome.passed == outcome.total else 0.0
        return outcome.fraction

    def score(self, completions: list[str], answers: list[str], sources: list[str] | None = None,
              ) -> tuple[list[float], dict[str, int]]:
        """Rewards in order, and counts of outcomes (``sandbox/<reason>``, ``sandbox/tests_passed``...).
        Every response runs its answer's tests, whatever its data source."""
        jobs = []
        for completion, answer in zip(completions, answers, strict=True):
            prefix, tests = decode_tests(answer)
            jobs.append(Job(prefix + extract_code(split_at_stop(completion)[0]), tuple(tests)))
        keys = [(j.code, tuple(j.tests)) for j in jobs]
        todo = [k for k in dict.fromkeys(keys) if self.cache is None or k not in self.cache]
        fresh = dict(zip(todo, self.sandbox.run_many([Job(c, t) for c, t in todo]), strict=True))
        outcomes = [fresh[k] if k in fresh else self._cached(k) for k in keys]
        if self.cache is not None:
            for k, o in fresh.items():
                self.cache[k] = o
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        counts: Counter[str] = Counter(f"sandbox/{o.reason.split(':')[0]}" for o in outcomes)
        counts["sandbox/executions"] = len(todo)
        counts["sandbox/cached"] = len(keys) - len(todo)
        counts["sandbox/tests_passed"] = sum(o.passed for o in outcomes)
        counts["sandbox/tests_run"] = sum(o.total for o in outcomes)
        return [self.reward(o) for o in outcomes], dict(counts)

    def _cached(self, key: tuple[str, tuple[str, ...]]) -> Outcome:
        assert self.cache is not None
        self.cache.move_to_end(key)
        return self.cache[key]


def code_scorer(cfg: RLBatchConfig) -> Callable[..., tuple[list[float], dict[str, int]]]:
    """The code_sandbox role's scorer."""
    return CodeScorer(cfg.sandbox).score
