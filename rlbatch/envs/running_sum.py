"""``running_sum``: each turn the env shows a digit, the policy answers the running sum mod 10.

Made for the tiny default model (its character tokenizer knows only ``0-9+-*=``): the first
observation is ``"3="``, the next ones ``"+5="``, ``"+4="``; each answer is one digit. A right
trajectory therefore reads ``3=3+5=8+4=2``, each turn the default arithmetic task's ``a+b=`` on
the previous answer. Reward: ``1/turns`` per right answer (the sum is the fraction right), or with
``scoring='all'`` 1 at the last turn only when every answer was right.

Task record: ``{"digits": [3, 5, 4]}``, or ``{}`` to draw the digits from the seed.
"""

from __future__ import annotations

import random

from rlbatch.envs.base import StepResult, Task
from rlbatch.rewards.rules import extract_answer


class RunningSum:
    def __init__(self, turns: int = 3, modulo: int = 10, scoring: str = "fraction") -> None:
        if not (isinstance(turns, int) and turns >= 1):
            raise ValueError(f"running_sum: turns must be an integer >= 1, got {turns!r}")
        if not (isinstance(modulo, int) and 2 <= modulo <= 10):
            raise ValueError(f"running_sum: modulo must be an integer in [2, 10] (one digit per answer), got {modulo!r}")
        if scoring not in ("fraction", "all"):
            raise ValueError(f"running_sum: scoring must be 'fraction' or 'all', got {scoring!r}")
        self.turns, self.modulo, self.scoring = turns, modulo, scoring
        self.digits: list[int] = []
        self.turn = 0
        self.right = 0

    def reset(self, task: Task, seed: int) -> str:
        digits = task.get("digits")
        if digits is None:
            rng = random.Random(seed)
            digits = [rng.randrange(self.modulo) for _ in range(self.turns)]
        if (not isinstance(digits, list) or len(digits) != self.turns
                or not all(isinstance(d, int) and 0 <= d < self.modulo for d in digits)):
            raise ValueError(f"running_sum: task digits must be {self.turns} integers in [0, {self.modulo}), "
                             f"got {digits!r}"[:200])
        self.digits, self.turn, self.right = [d for d in digits if isinstance(d, int)], 0, 0  # all of them
        return f"{self.digits[0]}="

    def expected(self) -> str:
        """The right answer to the current turn."""
        return str(sum(self.digits[: self.turn + 1]) % self.modulo)

    def step(self, action: str) -> StepResult:
        correct = extract_answer(action) == self.expected()
        self.right += correct
        self.turn += 1
        done = self.turn == self.turns
        if self.scoring == "fraction":
            reward = 1.0 / self.turns if correct else 0.0
        else:
            reward = 1.0 if done and self.right == self.turns else 0.0
        obs = "" if done else f"+{self.digits[self.turn]}="
        return StepResult(obs, reward, done, {"correct": correct})
