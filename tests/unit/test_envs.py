"""The built-in environments played by scripted policies through the guarded episode: right
answers earn the reward, wrong ones do not, and an episode is determined by its task and seed."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from rlbatch.config.parse import parse
from rlbatch.envs.episode import Episode, EpisodeLimits
from rlbatch.envs.frozenlake import MOVES, FrozenLake
from rlbatch.envs.lookup import Lookup
from rlbatch.envs.running_sum import RunningSum
from rlbatch.envs.setup import EnvSetup


def play(episode: Episode, policy: Any, task: dict[str, Any], seed: int) -> list[str]:
    """Run ``policy(observation) -> action`` to the end; the observations seen."""
    step = episode.start(task, seed)
    seen = [step.observation]
    while not step.done:
        step = episode.step(policy(step.observation))
        seen.append(step.observation)
    return seen


def running_sum_policy(right: set[int]) -> Any:
    """Adds up the digits it is shown; answers right on the turns in ``right`` (0-based), else wrong."""
    state = {"sum": 0, "turn": 0}

    def act(obs: str) -> str:
        state["sum"] = (state["sum"] + int(obs.strip("+="))) % 10
        turn, state["turn"] = state["turn"], state["turn"] + 1
        return f"{state['sum'] if turn in right else (state['sum'] + 1) % 10}<eos>"

    return act


@pytest.mark.parametrize(("right", "fraction", "all_"), [({0, 1, 2}, 1.0, 1.0), ({0, 2}, 2 / 3, 0.0), (set(), 0.0, 0.0)])
def test_running_sum_rewards_the_fraction_or_all_of_the_right_answers(right: set[int], fraction: float,
                                                                      all_: float) -> None:
    for scoring, want in (("fraction", fraction), ("all", all_)):
        ep = Episode(lambda s=scoring: RunningSum(scoring=s), EpisodeLimits(max_turns=8, step_timeout_s=10))
        seen = play(ep, running_sum_policy(right), {"digits": [3, 5, 4]}, seed=0)
        assert seen == ["3=", "+5=", "+4=", ""]  # the tiny tokenizer's alphabet: digits, '+', '='
        assert ep.end == "done" and ep.turns == 3
        assert sum(ep.rewards) == pytest.approx(want), (scoring, ep.rewards)


def test_running_sum_answers_must_be_exact_and_digits_come_from_the_seed() -> None:
    env = RunningSum()
    first = env.reset({}, seed=11)
    assert first == RunningSum().reset({}, seed=11) and first == f"{env.digits[0]}="
    assert len({RunningSum().reset({}, seed=s) for s in range(40)}) == 10  # the seed draws every digit
    assert env.step(f"{env.digits[0]}{env.digits[0]}").reward == 0.0  # "33" is not "3"
    with pytest.raises(ValueError, match="digits"):
        RunningSum().reset({"digits": [1, 12, 3]}, seed=0)


def lookup_policy(call_tool: bool, tags: tuple[str, str] = ("<tool_call>", "</tool_call>")) -> Any:
    """Reads the key from the question, calls lookup, answers with what the tool returned."""

    def act(obs: str) -> str:
        if "What is the value of" in obs:
            key = obs.split("What is the value of ")[1].split("?")[0]
            if call_tool:
                return f'{tags[0]}{{"name": "lookup", "arguments": {{"key": "{key}"}}}}{tags[1]}<eos>'
            return "1234<eos>"
        return obs.split("\n")[1] + "<eos>"  # the value inside <tool_response>\n...\n</tool_response>

    return act


def test_lookup_pays_only_for_the_value_read_from_the_tool() -> None:
    rewards = {}
    for call_tool in (True, False):
        ep = Episode(Lookup, EpisodeLimits(max_turns=4, step_timeout_s=10))
        seen = play(ep, lookup_policy(call_tool), {}, seed=5)
        rewards[call_tool] = sum(ep.rewards)
        if call_tool:
            assert seen[1].startswith("<tool_response>\n") and seen[1][len("<tool_response>\n"):][:4].isdigit()
            assert ep.turns == 2 and dict(ep.tool_outcomes) == {"ok": 1}
    assert rewards == {True: 1.0, False: 0.0}
    env = Lookup()
    env.reset({}, seed=5)
    assert env.table[env.key] not in env.reset({}, seed=5)  # the question never shows the value


def shortest_moves(lake: list[str]) -> list[str]:
    """Breadth-first search over the map the policy reads from the observation."""
    n = len(lake)
    start = next((r, c) for r in range(n) for c in range(n) if lake[r][c] == "P")
    todo, came = deque([start]), {start: ("", start)}
    while todo:
        r, c = todo.popleft()
        if lake[r][c] == "G":
            path, at = [], (r, c)
            while at != start:
                move, at = came[at]
                path.append(move)
            return path[::-1]
        for move, (dr, dc) in MOVES.items():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < n and 0 <= nxt[1] < n and nxt not in came and lake[nxt[0]][nxt[1]] != "H":
                came[nxt] = (move, (r, c))
                todo.append(nxt)
    raise AssertionError(f"no path in {lake}")


def lake_of(obs: str, size: int) -> list[str]:
    return obs.split("\n")[:size]


@pytest.mark.parametrize("seed", range(5))
def test_frozenlake_is_solved_by_a_planner_on_the_map_the_seed_draws(seed: int) -> None:
    size = 5
    solver = Episode(lambda: FrozenLake(size=size, holes=0.3), EpisodeLimits(max_turns=50, step_timeout_s=10))
    seen = play(solver, lambda obs: f"I go {shortest_moves(lake_of(obs, size))[0]}.", {}, seed)
    assert solver.end == "done" and sum(solver.rewards) == 1.0 and seen[-1].endswith("You reached the goal.")
    lake = lake_of(seen[0], size)
    assert lake == lake_of(FrozenLake(size=size, holes=0.3).reset({}, seed), size)  # the seed decides the map
    assert solver.turns == len(shortest_moves(lake))


def test_frozenlake_holes_invalid_moves_and_walls() -> None:
    task = {"map": ["SH", "FG"]}
    ep = Episode(FrozenLake, EpisodeLimits(max_turns=9, step_timeout_s=10))
    assert ep.start(task, 0).observation.startswith("PH\nFG")
    step = ep.step("jump!")
    assert not step.done and "Not a move" in step.observation and step.info["valid"] is False
    assert ep.step("up").observation == "PH\nFG"  # the edge holds the player where it is
    step = ep.step("right")
    assert step.done and step.reward == 0.0 and step.info["outcome"] == "hole" and ep.end == "done"


def test_env_setup_builds_episodes_from_the_config_section() -> None:
    setup = EnvSetup(parse({"env": {"name": "running_sum", "args": {"turns": 2}, "max_turns": 1, "step_timeout_s": 5}}).config)
    ep = setup.episode()
    assert ep.start({"digits": [1, 2]}, 0).observation == "1="
    step = ep.step("1")
    assert step.done and step.end == "max_turns" and step.reward == 0.5  # max_turns=1 ends a 2-turn game
    with pytest.raises(ValueError, match="env.name is not set"):
        EnvSetup(parse({"env": {"name": None}}).config)
