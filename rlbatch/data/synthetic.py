"""Synthetic prompt sets with known answers, and a seeded, resumable stream over them.

The default task is single-digit addition modulo 10 ("3+8=" -> "1"): 100 distinct prompts,
ten possible answers, so a random policy is right about once in ``len(vocab)`` tries and
the reward curve starts near zero, yet a tiny model learns the whole table by RL alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

Op = Literal["+", "-", "*"]


@dataclass(frozen=True)
class Sample:
    """One prompt, its ground-truth answer (as the reward function is given it) and the record's
    data source ('' when it names none: what ``data.reward_fns`` routes by)."""

    prompt: str
    answer: str
    data_source: str = ""
    images: tuple[bytes, ...] = ()
    """Encoded images (PNG, JPEG) of a vision-language prompt, one per ``<image>`` placeholder of
    ``prompt``, in order (``rlbatch.data.images``)."""


def arithmetic_problems(op: Op = "+", max_operand: int = 9, modulo: int | None = 10) -> tuple[Sample, ...]:
    """Every ``"a{op}b="`` prompt with ``0 <= a, b <= max_operand``, in a fixed order.

    With ``modulo`` the answer is reduced mod it, which keeps every answer a single token
    (one decision per prompt); ``None`` keeps the plain result. Subtraction keeps only
    ``a >= b`` so answers never need a minus sign.
    """
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    if modulo is not None and modulo < 1:
        raise ValueError(f"modulo must be >= 1 or None, got {modulo}")
    problems = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            if op == "+":
                value = a + b
            elif op == "-":
                if a < b:
                    continue
                value = a - b
            elif op == "*":
                value = a * b
            else:
                raise ValueError(f"unknown op {op!r}; expected '+', '-' or '*'")
            if modulo is not None:
                value %= modulo
            problems.append(Sample(prompt=f"{a}{op}{b}=", answer=str(value)))
    return tuple(problems)


class PromptStream:
    """An endless, seeded stream over a finite problem set, in shuffled epochs.

    Position ``i`` maps to problem ``perm_e[i % N]`` where ``perm_e`` is the permutation of
    epoch ``e = i // N`` drawn from ``(seed, e)``. Every epoch visits each problem once (an
    even spread of prompts per step helps the learning curve), the same seed always gives
    the same stream, and resuming needs only the position: no RNG state is carried.
    """

    def __init__(self, problems: tuple[Sample, ...] | list[Sample], seed: int, position: int = 0):
        if not problems:
            raise ValueError("PromptStream needs at least one problem")
        self._problems = tuple(problems)
        self._seed = int(seed)
        self._position = int(position)
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def position(self) -> int:
        """How many samples the stream has handed out."""
        return self._position

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self._seed, epoch])
            self._perm = rng.permutation(len(self._problems))
            self._epoch = epoch
        return self._perm

    def next_batch(self, n: int) -> list[Sample]:
        """The next ``n`` samples; advances the position by ``n``."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        size = len(self._problems)
        out = []
        for i in range(self._position, self._position + n):
            out.append(self._problems[int(self._permutation(i // size)[i % size])])
        self._position += n
        return out

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint needs to resume this stream exactly."""
        return {"seed": self._seed, "position": self._position, "num_problems": len(self._problems)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume from :meth:`state_dict`; refuses a state from a different problem set size."""
        if int(state["num_problems"]) != len(self._problems):
            raise ValueError(
                f"stream state is for {state['num_problems']} problems, this stream has {len(self._problems)}"
            )
        self._seed = int(state["seed"])
        self._position = int(state["position"])
        self._epoch = -1
