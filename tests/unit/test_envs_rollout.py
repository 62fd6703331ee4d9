"""Multi-turn rollouts (rlbatch.envs.rollout): token in, token out; each trajectory advanced on its
own while slow envs step; the turn-barrier baseline; limits and failures end only their trajectory.

A scripted engine stands in for the policy where the test needs to know each answer: it answers
running_sum right (or wrong where told) after as many engine steps as the answer has tokens, as a
real engine would take one decode step per token. The hf engine runs one rollout for real."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch

from rlbatch.config.compose import compose
from rlbatch.engines.base import BatchedTurns, EngineContext, Generation, SamplingParams, TurnRequest
from rlbatch.engines.model import load_tokenizer
from rlbatch.envs.chat import PlainText
from rlbatch.envs.episode import Episode, EpisodeLimits
from rlbatch.envs.rollout import Rollout, Start
from rlbatch.envs.running_sum import RunningSum

TOK = load_tokenizer(compose([]).model)
EOS = TOK.eos_token_id


def encode(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False))


def decode(tokens: list[int]) -> str:
    return str(TOK.decode(tokens, skip_special_tokens=True))


class ScriptedTurns:
    """Answers a running_sum context with the right sum (``wrong``: keys answered off by one) and
    EOS, finishing ``len(answer) + extra[key]`` engine steps after it was submitted."""

    def __init__(self, wrong: set[int] = frozenset(), extra: dict[int, int] | None = None) -> None:  # type: ignore[assignment]
        self.wrong, self.extra = wrong, extra or {}
        self.running: dict[int, list[Any]] = {}
        self.submitted: list[list[int]] = []

    def submit(self, requests: list[TurnRequest], params: SamplingParams) -> None:
        self.submitted.append([r.key for r in requests])
        for r in requests:
            numbers = [int(x) for x in re.findall(r"\d", decode(r.tokens))]
            # the context reads d0 = a0 + d1 = a1 + ... : the next answer is the running sum of the shown digits
            shown = numbers[0::2]
            answer = (sum(shown) + (1 if r.key in self.wrong else 0)) % 10
            tokens = encode(str(answer)) + [EOS]
            self.running[r.key] = [len(tokens) + self.extra.get(r.key, 0), Generation(tokens, [-0.5] * len(tokens))]

    def poll(self, block: bool = True) -> list[tuple[int, Generation]]:
        out: list[tuple[int, Generation]] = []
        while self.running and not out:
            for key in list(self.running):
                self.running[key][0] -= 1
                if self.running[key][0] <= 0:
                    out.append((key, self.running.pop(key)[1]))
            if not block:
                break
        return out

    def in_flight(self) -> int:
        return len(self.running)


class SlowSum(RunningSum):
    """running_sum whose step sleeps ``delay`` seconds (an env that calls out to something slow)."""

    def __init__(self, delay: float = 0.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.delay = delay

    def step(self, action: str) -> Any:
        time.sleep(self.delay)
        return super().step(action)


def starts(n: int, delays: dict[int, float] | None = None, limits: EpisodeLimits | None = None) -> list[Start]:
    delays = delays or {}
    return [Start(k, [], Episode(lambda k=k: SlowSum(delays.get(k, 0.0), turns=3), limits or EpisodeLimits(8, 10.0)),
                  {"digits": [k % 10, (k + 3) % 10, (k + 5) % 10]}, seed=k) for k in range(n)]


def test_the_trained_tokens_are_the_generated_ones_and_the_observations_byte_for_byte() -> None:
    out = Rollout(ScriptedTurns(wrong={2}), PlainText(encode), decode, SamplingParams(4)).run(starts(4))
    for traj in out:
        d = traj.key
        a, b, c = d % 10, (d + 3) % 10, (d + 5) % 10
        off = 1 if d == 2 else 0
        answers = [(a + off) % 10, (a + b + off) % 10, (a + b + c + off) % 10]
        assert decode(traj.prompt) == f"{a}="  # the first observation is the prompt (the task gave none)
        want = [*encode(str(answers[0])), EOS, *encode(f"+{b}="), *encode(str(answers[1])), EOS, *encode(f"+{c}="),
                *encode(str(answers[2])), EOS]
        assert traj.response == want
        gen = [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]  # answer + EOS trained, '+b=' the env's
        assert traj.loss_mask == gen and len(traj.logprobs) == len(want)
        assert [lp for lp, m in zip(traj.logprobs, gen, strict=True) if m] == [-0.5] * 6
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, gen, strict=True) if not m)
        assert (traj.turns, traj.end, traj.generated, traj.observed) == (3, "done", 6, 6)
        assert traj.reward == pytest.approx(0.0 if d == 2 else 1.0)
        assert len(traj.rewards) == 3 and traj.info["turns"] == 3
        assert traj.reward_at == [2, 4, 6]  # each turn's reward after its answer and EOS: 2 generated tokens a turn


def test_a_trajectory_goes_on_while_another_env_is_slow_and_the_barrier_waits() -> None:
    """Trajectory 0's env takes 0.6 s a step. Per trajectory, the others finish all three turns
    during its first step; with the barrier, nobody's second turn starts before its first step ends."""
    delays = {0: 0.6}
    free = Rollout(ScriptedTurns(), PlainText(encode), decode, SamplingParams(4))
    a = free.run(starts(4, delays))
    ended = {k: s for s, k, e in free.timeline if e == "ended"}
    first_obs_0 = sorted(s for s, k, e in free.timeline if k == 0 and e == "observed")[1]  # [0]: its opening
    assert all(ended[k] < first_obs_0 for k in (1, 2, 3)), free.timeline
    barrier = Rollout(ScriptedTurns(), PlainText(encode), decode, SamplingParams(4), barrier=True)
    b = barrier.run(starts(4, delays))
    gens = sorted((s, k) for s, k, e in barrier.timeline if e == "generated")
    slow_steps_end = sorted(s for s, k, e in barrier.timeline if k == 0 and e in ("observed", "ended"))[1:]
    for turn_end in slow_steps_end[:2]:  # every turn after the slow env's step, never before it ends
        assert sum(1 for s, _ in gens if s < turn_end) % 4 == 0, barrier.timeline
    assert [x.response for x in a] == [x.response for x in b]  # same trajectories, another schedule
    assert [sorted(keys) for keys in barrier.turns.submitted] == [[0, 1, 2, 3]] * 3  # type: ignore[attr-defined]
    assert len(free.turns.submitted) > 3  # type: ignore[attr-defined]  # turns submitted as envs answered


def test_limits_and_a_failing_env_end_only_their_trajectory() -> None:
    class Broken(RunningSum):
        def step(self, action: str) -> Any:
            raise RuntimeError("env bug")

    s = starts(3)
    s[1] = Start(1, [], Episode(lambda: Broken(turns=3), EpisodeLimits(8, 10.0)), {"digits": [1, 2, 3]}, seed=1)
    s[2] = Start(2, [], Episode(lambda: RunningSum(turns=3), EpisodeLimits(2, 10.0)), {"digits": [1, 2, 3]}, seed=2)
    out = Rollout(ScriptedTurns(), PlainText(encode), decode, SamplingParams(4)).run(s)
    assert [(t.end, t.turns) for t in out] == [("done", 3), ("error", 1), ("max_turns", 2)]
    assert out[0].reward == pytest.approx(1.0)
    # a context budget: the prompt '0=' (2) + '0' EOS (2) + '+3=' (3) = 7 fits, the next observation does not
    short = Rollout(ScriptedTurns(), PlainText(encode), decode, SamplingParams(4), max_context=9).run(starts(1))
    (t,) = short
    assert t.end == "max_context" and len(t.context()) <= 9 and t.turns == 2
    assert sum(t.loss_mask) == t.generated == 4


def test_the_hf_engine_rolls_out_running_sum_with_batched_turns() -> None:
    from rlbatch.engines.hf import HFArgs
    from rlbatch.engines.hf.engine import HFInferenceEngine

    cfg = compose([])
    engine = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, TOK, torch.device("cpu"), seed=1))
    out = Rollout(BatchedTurns(engine), PlainText(encode), decode, SamplingParams(3, temperature=1.0)).run(starts(6), seed=4)
    for traj in out:
        assert traj.end in ("done", "max_context") and 1 <= traj.turns <= 3
        assert len(traj.response) == len(traj.loss_mask) == len(traj.logprobs)
        assert sum(traj.loss_mask) == traj.generated and len(traj.response) == traj.generated + traj.observed
        assert all(lp < 0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m)
        assert 0.0 <= traj.reward <= 1.0
