"""``lookup``: the answer is in a table the policy can read only through the ``lookup`` tool.

The first observation names a key (``k3``); the table (keys ``k0..k{keys-1}``, each a random
``digits``-digit value drawn from the seed) is never shown. The policy calls
``{"name": "lookup", "arguments": {"key": "k3"}}`` (in the episode's tool-call tags), reads the
value from the tool's response, and answers with it: reward 1 for the right value, the episode
ends with the first answer that is not a tool call. A guess is right with probability
``10**-digits``, so the reward measures tool use.

For a model with a small alphabet (the tiny default model writes ``0-9+-*=``): ``key_prefix=''``
names the keys ``0..{keys-1}`` and ``question='{key}='`` asks ``3=``; with the compact tool-call
format and tags ``*``/``=``, ``+``/``=`` a right trajectory reads ``3=*3`` ``+7=`` ``7``
(``experiment=tooluse``).

Two settings shape the reward for a policy that has never called a tool (``experiment=tooluse``).
``lookup_reward`` (default 0) is the reward of a wrong answer after a lookup of the asked key:
the call pays before the copied answer does. ``read_first`` (default false): a right answer
counts only after a lookup of the asked key. With one-digit values a guess is right 1 time in 9,
and a model learning from scratch finds guessing (two tokens, the same for every key) before
the call and its key (measured: a tiny model that guesses and has unlearned calling by step 10).

Task record: ``{"key": "k3", "table": {"k3": "4711", ...}}``, or ``{}`` to draw both from the seed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from rlbatch.envs.base import StepResult, Task, Tool
from rlbatch.rewards.rules import extract_answer


class Lookup:
    def __init__(self, keys: int = 8, digits: int = 4, key_prefix: str = "k", question: str | None = None,
                 lookup_reward: float = 0.0, read_first: bool = False) -> None:
        if not (isinstance(keys, int) and keys >= 1) or not (isinstance(digits, int) and 1 <= digits <= 18):
            raise ValueError(f"lookup: keys must be an integer >= 1 and digits one in [1, 18], got {keys!r}, {digits!r}")
        if not isinstance(key_prefix, str) or (question is not None and not (isinstance(question, str)
                                                                             and "{key}" in question)):
            raise ValueError(f"lookup: key_prefix must be text and question text holding '{{key}}' (or null), "
                             f"got {key_prefix!r}, {question!r}"[:300])
        if not (isinstance(lookup_reward, (int, float)) and 0.0 <= lookup_reward < 1.0):
            raise ValueError(f"lookup: lookup_reward must be a number in [0, 1), got {lookup_reward!r}")
        self.keys, self.digits, self.key_prefix, self.question = keys, digits, key_prefix, question
        if not isinstance(read_first, bool):
            raise ValueError(f"lookup: read_first must be true or false, got {read_first!r}")
        self.lookup_reward, self.read_first = float(lookup_reward), read_first
        self.found = False
        self.table: dict[str, str] = {}
        self.key = ""
        self.looked_up = 0
        self.tools: dict[str, Tool] = {"lookup": self.lookup}

    def reset(self, task: Task, seed: int) -> str:
        rng = random.Random(seed)
        table = task.get("table")
        if table is None:
            table = {f"{self.key_prefix}{i}": str(rng.randrange(10 ** (self.digits - 1), 10**self.digits)) for i in range(self.keys)}
        if not isinstance(table, Mapping) or not table:
            raise ValueError(f"lookup: task table must be a non-empty mapping, got {table!r}"[:200])
        self.table = {str(k): str(v) for k, v in table.items()}
        key = task.get("key")
        self.key = str(key) if key is not None else rng.choice(sorted(self.table))
        if self.key not in self.table:
            raise ValueError(f"lookup: task key {self.key!r} is not in its table")
        self.looked_up, self.found = 0, False
        if self.question is not None:  # replaced, not str.format: the config's text is never evaluated
            return self.question.replace("{key}", self.key)
        return (f"What is the value of {self.key}? It is only in the lookup table: call the lookup tool "
                f"with the key, then answer with the value alone.")

    def lookup(self, key: str) -> str:
        """The value stored under ``key``."""
        self.looked_up += 1
        self.found = self.found or key == self.key
        if key not in self.table:
            return f"no entry {key!r}"[:100]
        return self.table[key]

    def step(self, action: str) -> StepResult:
        correct = extract_answer(action) == self.table[self.key]
        paid = correct and (self.found or not self.read_first)
        reward = 1.0 if paid else self.lookup_reward if self.found else 0.0
        return StepResult("", reward, True, {"correct": correct, "lookups": self.looked_up})
