"""``frozenlake``: a text FrozenLake (a grid game in the style of ROLL's agentic examples),
written only against the ``Env`` contract, as a user's env would be (docs/agents.md shows it
as a plugin).

The policy walks from ``S`` to ``G`` on an ``size`` x ``size`` lake without stepping into a hole
``H``; the map comes from the seed (a path from start to goal always exists) and moves are not
slippery, so an episode is fully determined by the seed and the actions. Each observation is the
map with the player as ``P``; an action is one of ``up``, ``down``, ``left``, ``right`` (the
first such word in the text). Reward 1 on reaching the goal; a hole ends the episode with 0; an
action that is none of the four costs a turn and says so.

Task record: ``{"map": ["SFFF", "FHFH", "FFFH", "HFFG"]}``, or ``{}`` to draw one from the seed.
"""

from __future__ import annotations

import random
import re

from rlbatch.envs.base import StepResult, Task

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_WORD = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)


def _reachable(lake: list[str]) -> bool:
    n = len(lake)
    seen, todo = {(0, 0)}, [(0, 0)]
    while todo:
        r, c = todo.pop()
        if lake[r][c] == "G":
            return True
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in seen and lake[nr][nc] != "H":
                seen.add((nr, nc))
                todo.append((nr, nc))
    return False


def random_lake(size: int, holes: float, rng: random.Random) -> list[str]:
    """A size x size map, S top left, G bottom right, each other cell a hole with probability
    ``holes``, drawn again until the goal is reachable."""
    while True:
        cells = [["H" if rng.random() < holes else "F" for _ in range(size)] for _ in range(size)]
        cells[0][0], cells[-1][-1] = "S", "G"
        lake = ["".join(row) for row in cells]
        if _reachable(lake):
            return lake


class FrozenLake:
    def __init__(self, size: int = 4, holes: float = 0.2) -> None:
        if not (isinstance(size, int) and 2 <= size <= 16) or not (isinstance(holes, (int, float)) and 0 <= holes < 0.8):
            raise ValueError(f"frozenlake: size must be an integer in [2, 16] and holes a fraction in [0, 0.8), "
                             f"got {size!r}, {holes!r}")
        self.size, self.holes = size, float(holes)
        self.lake: list[str] = []
        self.pos = (0, 0)

    def reset(self, task: Task, seed: int) -> str:
        lake: object = task.get("map")
        if lake is None:
            lake = random_lake(self.size, self.holes, random.Random(seed))
        rows = [r for r in lake if isinstance(r, str)] if isinstance(lake, list) else []
        if (not isinstance(lake, list) or not lake or len(rows) != len(lake) or any(len(r) != len(lake) for r in rows)
                or rows[0][0] != "S" or set("".join(rows)) - set("SFHG")):
            raise ValueError(f"frozenlake: task map must be a square of 'S', 'F', 'H', 'G' rows with S top left, "
                             f"got {lake!r}"[:200])
        self.lake, self.pos = rows, (0, 0)
        return self.render() + "\nActions: up, down, left, right."

    def render(self) -> str:
        rows = [list(row) for row in self.lake]
        rows[self.pos[0]][self.pos[1]] = "P"
        return "\n".join("".join(row) for row in rows)

    def step(self, action: str) -> StepResult:
        word = _WORD.search(action)
        if word is None:
            return StepResult(f"{self.render()}\nNot a move: answer up, down, left or right.", 0.0, False,
                              {"valid": False})
        dr, dc = MOVES[word.group(1).lower()]
        r = min(max(self.pos[0] + dr, 0), len(self.lake) - 1)
        c = min(max(self.pos[1] + dc, 0), len(self.lake) - 1)
        self.pos = (r, c)
        cell = self.lake[r][c]
        if cell == "H":
            return StepResult(f"{self.render()}\nYou fell into a hole.", 0.0, True, {"valid": True, "outcome": "hole"})
        if cell == "G":
            return StepResult(f"{self.render()}\nYou reached the goal.", 1.0, True, {"valid": True, "outcome": "goal"})
        return StepResult(self.render(), 0.0, False, {"valid": True})
