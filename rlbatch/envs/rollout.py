"""Multi-turn rollouts: many trajectories, each advanced on its own.

A trajectory starts from its task's prompt and its episode's first observation; each turn the
policy generates (``rlbatch.engines.base.Turns``), its action goes to its episode (``Episode``,
run on a thread pool so that slow env steps overlap with generation and with each other), and the
observation that comes back is tokenized once and appended (``rlbatch.envs.chat``: as plain text,
or as a message of the model's chat template). Token in, token out: the trained
sequence is exactly the tokens the policy saw, the prompt then ``response`` (generated and
observation tokens interleaved), with ``loss_mask`` 1 on generated tokens and 0 on observations and
a behaviour log-prob for every generated token.

    rollout = Rollout(turns, PlainText(encode), decode, SamplingParams(max_new_tokens=4), max_context=256)
    done = rollout.run([Start(key, prompt_tokens, episode, task, seed), ...])

``barrier=False`` (the default): a trajectory whose turn is generated goes to its env at once, and
its next turn goes back to the engine as soon as the env answers, while the others are anywhere in
between; the engine keeps generating for whatever is ready. ``barrier=True`` runs every
trajectory's turn, then every env step, then the next turn: the baseline a per-trajectory rollout
is measured against. The two give the same trajectories where the engine's samples do not depend
on what is batched together (greedy, or per-request seeds: vLLM), since each request's seed comes
from the rollout's seed, its trajectory and its turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from rlbatch.engines.base import Generation, SamplingParams, TurnRequest, Turns
from rlbatch.envs.base import Task
from rlbatch.envs.chat import Observations
from rlbatch.envs.episode import EpisodeHandle, EpisodeSummary, Step


@dataclass
class Start:
    """One trajectory to roll out: its key, the task's prompt tokens (may be empty: the env's first
    observation is then the whole prompt), its episode and what starts it."""

    key: int
    prompt: list[int]
    episode: EpisodeHandle
    task: Task
    seed: int


@dataclass
class Trajectory:
    """A finished trajectory, as the trainer reads it."""

    key: int
    prompt: list[int]
    """The task's prompt and the first observation: what the policy saw before its first turn."""
    response: list[int] = field(default_factory=list)
    """Every token after the prompt: generated turns and the observations between them."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on generated tokens (trained), 0 on observation tokens (the env's)."""
    logprobs: list[float] = field(default_factory=list)
    """The behaviour log-prob of each generated token; 0 on observation tokens (masked)."""
    rewards: list[float] = field(default_factory=list)
    """The env's reward after each turn."""
    reward_at: list[int] = field(default_factory=list)
    """For each reward, the tokens the policy had generated when it came (its turn's end among the
    trajectory's actions)."""
    turns: int = 0
    end: str = ""
    """Why it ended (``rlbatch.envs.base.END_REASONS``)."""
    info: EpisodeSummary = field(default_factory=EpisodeSummary)
    """The episode's summary (turns, tool calls by outcome, env seconds, ...)."""
    generated: int = 0
    observed: int = 0

    @property
    def reward(self) -> float:
        """The trajectory's reward: the sum of its turns' rewards."""
        return float(sum(self.rewards))

    def context(self) -> list[int]:
        return self.prompt + self.response


class Rollout:
    """Runs trajectories to their end on one inference engine's ``Turns``.

    ``observations``: how observation text becomes tokens (``rlbatch.envs.chat``: plain text or
    chat messages). ``decode``: generated tokens -> the action text the env reads. ``max_context``: a trajectory whose context would exceed it ends ('max_context') before
    its next turn; an observation no turn reads (at the end of the episode, or one that leaves no
    room for a turn) is left out, so a response ends with a generated turn. ``workers``: threads
    stepping envs."""

    def __init__(self, turns: Turns, observations: Observations, decode: Callable[[list[int]], str],
                 params: SamplingParams, max_context: int | None = None, workers: int = 8, barrier: bool = False) -> None:
        self.turns, self.observations, self.decode, self.params = turns, observations, decode, params
        self.max_context, self.workers, self.barrier = max_context, max(1, workers), barrier
        self.timeline: list[tuple[float, int, str]] = []
        """(seconds since the run began, trajectory key, event): 'generated', 'observed', 'ended'."""

    def run(self, starts: list[Start], seed: int = 0) -> list[Trajectory]:
        """Every trajectory to its end, returned in the order of ``starts``."""
        t0 = time.perf_counter()
        live: dict[int, tuple[Start, Trajectory]] = {}
        for s in starts:
            if s.key in live:
                raise ValueError(f"trajectory key {s.key} appears twice")
            live[s.key] = (s, Trajectory(s.key, list(s.prompt)))
        done: dict[int, Trajectory] = {}
        ready: list[int] = []  # answered by their env, their next turn not yet submitted
        opening = set(live)

        def event(key: int, what: str) -> None:
            self.timeline.append((time.perf_counter() - t0, key, what))

        with ThreadPoolExecutor(self.workers, thread_name_prefix="env") as pool:
            stepping: dict[Future[Step], int] = {pool.submit(s.episode.start, s.task, s.seed): s.key for s in starts}

            def settle(futures: set[Future[Step]]) -> None:
                for f in futures:
                    key = stepping.pop(f)
                    start, traj = live[key]
                    if self._observe(traj, start, f.result(), opening=key in opening):
                        done[key] = live.pop(key)[1]
                        event(key, "ended")
                    else:
                        ready.append(key)
                        event(key, "observed")
                    opening.discard(key)

            def generated(finished: list[tuple[int, Generation]]) -> None:
                for key, gen in finished:
                    start, traj = live[key]
                    self._act(traj, gen)
                    event(key, "generated")
                    stepping[pool.submit(start.episode.step, self.decode(gen.tokens))] = key

            while live:
                if ready:  # in key order: which env answered first must not reorder a batch
                    self.turns.submit([TurnRequest(k, live[k][1].context(), _request_seed(seed, k, live[k][1].turns))
                                       for k in sorted(ready)], self.params)
                    ready.clear()
                if self.barrier:  # every turn, then every env step, then the next turn
                    while self.turns.in_flight():
                        generated(self.turns.poll())
                    settle(set(wait(list(stepping)).done))
                elif self.turns.in_flight():  # envs still stepping: advance the engine a step, look back
                    generated(self.turns.poll(block=not stepping))
                    settle({f for f in list(stepping) if f.done()})
                elif stepping:
                    settle(set(wait(list(stepping), return_when=FIRST_COMPLETED).done))
        for start in starts:
            start.episode.close()
        return [done[s.key] for s in starts]

    def _act(self, traj: Trajectory, gen: Generation) -> None:
        traj.response += gen.tokens
        traj.loss_mask += [1] * len(gen.tokens)
        traj.logprobs += gen.logprobs
        traj.generated += len(gen.tokens)
        traj.turns += 1

    def _observe(self, traj: Trajectory, start: Start, step: Step, opening: bool) -> bool:
        """Append the env's answer; True when the trajectory has ended."""
        if opening:  # the first observation completes the prompt
            prompt = self.observations.opening(traj.prompt, step.observation) if step.observation else traj.prompt
            length = len(prompt)
        else:
            tokens = [] if step.done else self.observations.after(_last_turn(traj), step.observation)
            length = len(traj.context()) + len(tokens)
        over = self.max_context is not None and length > self.max_context
        full = self.max_context is not None and length >= self.max_context
        if opening:
            if not over:
                traj.prompt = list(prompt)
        elif not (step.done or full):  # an observation no turn reads is left out: a response ends with a turn
            traj.response += tokens
            traj.loss_mask += [0] * len(tokens)
            traj.logprobs += [0.0] * len(tokens)
            traj.observed += len(tokens)
        if not opening:  # an episode's start gives an observation only
            traj.rewards.append(float(step.reward))
            traj.reward_at.append(traj.generated)
        if step.done:
            traj.end = str(step.end)
        elif full:  # no room left for a turn
            traj.end = str(start.episode.stop("max_context").end)
        if traj.end:
            traj.info = start.episode.summary()
            return True
        return False


def _last_turn(traj: Trajectory) -> list[int]:
    """The trajectory's last generated turn: the generated tokens at the end of its response."""
    n = 0
    while n < len(traj.loss_mask) and traj.loss_mask[-1 - n]:
        n += 1
    return traj.response[len(traj.response) - n:]


def _request_seed(seed: int, key: int, turn: int) -> int:
    """A request's sampling seed from the rollout's, its trajectory's and its turn: the same
    whatever else is generating (where the engine honours per-request seeds)."""
    return (seed * 1_000_003 + key * 10_007 + turn) % (1 << 31)
