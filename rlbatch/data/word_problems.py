"""Arithmetic word problems generated from a seed (``data.name=word_arithmetic``).

A problem is an operation and its two operands (``("+", 17, 25)``), told in words by one of a few
templates with a name and an object ("Tom has 17 apples and buys 25 more. How many apples does he
have now?"); the answer is the number. The pool holds every triple once, and each triple is told
once: held-out problems (``eval.holdout=N``, drawn by index from the pool and left out of the
training stream) therefore share no triple with the training problems, in any wording.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlbatch.data.synthetic import Sample

SEED = 20261207
"""The seed of the built-in pool: its order and each problem's wording."""

NAMES = (("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Maria", "she"), ("Sam", "he"), ("Lily", "she"),
         ("Omar", "he"), ("Chen", "he"), ("Sofia", "she"), ("Ravi", "he"), ("Emma", "she"), ("Leo", "he"))
THINGS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "coins", "stamps", "shells",
          "cards", "oranges", "balloons")

TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": ("{Name} has {a} {things} and buys {b} more. How many {things} does {he} have now?",
          "{Name} picked {a} {things} in the morning and {b} {things} in the afternoon. How many {things} did {he} pick in all?",
          "There are {a} {things} in a box. {Name} puts {b} more {things} in the box. How many {things} are in the box now?",
          "{Name} found {a} {things} on Monday and {b} {things} on Tuesday. How many {things} did {he} find altogether?"),
    "-": ("{Name} has {a} {things} and gives {b} of them to a friend. How many {things} does {he} have left?",
          "There were {a} {things} on the table. {Name} took {b} of them. How many {things} are still on the table?",
          "{Name} had {a} {things} and lost {b}. How many {things} does {he} have now?",
          "A shop had {a} {things}. It sold {b} of them to {Name}. How many {things} does the shop have left?"),
    "*": ("{Name} has {a} bags with {b} {things} in each bag. How many {things} does {he} have in all?",
          "{Name} buys {a} packs of {things}. Each pack holds {b} {things}. How many {things} did {he} buy?",
          "There are {a} rows of {things} with {b} {things} in each row. How many {things} are there?"),
}
"""Wordings per operation: ``{a}`` and ``{b}`` are the operands, in that order."""


@dataclass(frozen=True)
class Problem:
    op: str
    a: int
    b: int

    @property
    def value(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b if self.op == "-" else self.a * self.b


def pool(max_sum: int = 20, max_factor: int = 6) -> tuple[Problem, ...]:
    """Every triple, in a fixed order: sums of two numbers from 2 up to ``max_sum`` - 2 (sum at most
    ``max_sum``), differences ``a - b`` with ``2 <= b < a <= max_sum``, and products of two factors
    from 2 to ``max_factor``."""
    out = [Problem("+", a, b) for a in range(2, max_sum) for b in range(2, max_sum - a + 1)]
    out += [Problem("-", a, b) for a in range(3, max_sum + 1) for b in range(2, a)]
    out += [Problem("*", a, b) for a in range(2, max_factor + 1) for b in range(2, max_factor + 1)]
    return tuple(out)


def tell(p: Problem, rng: random.Random) -> str:
    """The problem in words: one of its operation's templates, with a name and an object drawn by ``rng``."""
    name, he = rng.choice(NAMES)
    template = rng.choice(TEMPLATES[p.op])
    return template.format(Name=name, he=he, a=p.a, b=p.b, things=rng.choice(THINGS))


def word_problems(seed: int = SEED) -> tuple[Sample, ...]:
    """Every triple of the built-in pool told once, in words, in an order and wording drawn by ``seed``:
    question text and answer."""
    rng = random.Random(seed)
    order = list(pool())
    rng.shuffle(order)
    return tuple(Sample(tell(p, rng), str(p.value)) for p in order)
