"""``lookup``: the answer is in a table the policy can read only through the ``lookup`` tool.

The first observation names a key (``k3``); the table (keys ``k0..k{keys-1}``, each a random
``digits``-digit value drawn from the seed) is never shown. The policy calls
``{"name": "lookup", "arguments": {"key": "k3"}}`` (in the episode's tool-call tags), reads the
value from the tool's response, and answers with it: reward 1 for the right value, the episode
ends with the first answer that is not a tool call. A guess is right with probability
``10**-digits``, so the reward measures tool use.

Task record: ``{"key": "k3", "table": {"k3": "4711", ...}}``, or ``{}`` to draw both from the seed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from rlbatch.envs.base import StepResult, Tool
from rlbatch.rewards.rules import extract_answer


class Lookup:
    def __init__(self, keys: int = 8, digits: int = 4) -> None:
        if not (isinstance(keys, int) and keys >= 1) or not (isinstance(digits, int) and 1 <= digits <= 18):
            raise ValueError(f"lookup: keys must be an integer >= 1 and digits one in [1, 18], got {keys!r}, {digits!r}")
        self.keys, self.digits = keys, digits
        self.table: dict[str, str] = {}
        self.key = ""
        self.looked_up = 0
        self.tools: dict[str, Tool] = {"lookup": self.lookup}

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        rng = random.Random(seed)
        table = task.get("table")
        if table is None:
            table = {f"k{i}": str(rng.randrange(10 ** (self.digits - 1), 10**self.digits)) for i in range(self.keys)}
        if not isinstance(table, Mapping) or not table:
            raise ValueError(f"lookup: task table must be a non-empty mapping, got {table!r}"[:200])
        self.table = {str(k): str(v) for k, v in table.items()}
        key = task.get("key")
        self.key = str(key) if key is not None else rng.choice(sorted(self.table))
        if self.key not in self.table:
            raise ValueError(f"lookup: task key {self.key!r} is not in its table")
        self.looked_up = 0
        return (f"What is the value of {self.key}? It is only in the lookup table: call the lookup tool "
                f"with the key, then answer with the value alone.")

    def lookup(self, key: str) -> str:
        """The value stored under ``key``."""
        self.looked_up += 1
        if key not in self.table:
            return f"no entry {key!r}"[:100]
        return self.table[key]

    def step(self, action: str) -> StepResult:
        correct = extract_answer(action) == self.table[self.key]
        return StepResult("", 1.0 if correct else 0.0, True, {"correct": correct, "lookups": self.looked_up})
