"""The generate phase of a run with an environment (``env.name``): each sample is a trajectory.

The controller sends an inference worker its samples as usual (``samples_per_prompt`` consecutive
ones per prompt) plus each sample's task record and episode seed; the samples of one prompt share
both, so a GRPO group is ``n`` trajectories from the same episode start and its baseline compares
like with like. The worker's first rank plays them all to their end with ``Rollout`` over its
engine's ``Turns`` (each trajectory on its own), and each becomes one sample:

    prompt              the task's prompt tokens, then the first observation's
    response            every token after it: generated turns and the observations between them
    behaviour_logprobs  aligned with response, 0 on observation tokens
    loss_mask           1 on generated tokens, 0 on observation tokens (``rlbatch.phases.TRAJECTORY_FIELDS``)

and a small summary (the trajectory's reward, turns, end reason, env seconds, tool calls) goes back
to the controller: the reward to the score phase, the rest to the step's metrics
(``trajectory_stats``).

    rollout = MultiTurn(cfg, tokenizer)                  # envs on this rank's threads
    rollout = MultiTurn(cfg, tokenizer, client=client)   # envs on the env role's workers
    trajectories = rollout(engine, prompts, sampling, tasks, seeds, seed, ids)

With an ``env`` role (``roles.env.world_size``) each trajectory's episode lives on the env worker
its sample id picks (``rlbatch.envs.client``), behind the same ``Episode`` methods, so the rollout
loop and the trajectories are the same either way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict

import torch

from rlbatch.config.schema import RLBatchConfig
from rlbatch.data.synthetic import Sample
from rlbatch.engines.base import InferenceEngine, SamplingParams, Turns, turns_of
from rlbatch.envs.base import END_REASONS, TOOL_OUTCOMES, Task
from rlbatch.envs.chat import ChatTurns, Observations, PlainText
from rlbatch.envs.client import EnvClient, worker_of
from rlbatch.envs.episode import EpisodeHandle
from rlbatch.envs.rollout import Rollout, Start, Trajectory
from rlbatch.envs.setup import EnvSetup

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from typing_extensions import TypeIs


def episode_seed(run_seed: int, group: int) -> int:
    """The seed every trajectory of one group (one prompt's samples) resets its episode with: from
    the run's seed and the group's number in the run (its first sample id // samples_per_prompt),
    so it does not depend on which worker plays it, and a restarted step replays the same starts."""
    return (int(run_seed) * 1_000_003 + int(group) * 7_919) % (1 << 31)


def task_of(prompt: Sample) -> dict[str, str]:
    """The task record an episode starts from: the data set record's answer and source (the
    built-in envs draw what their record lacks from the seed)."""
    task: dict[str, str] = {"answer": str(getattr(prompt, "answer", ""))}
    source = str(getattr(prompt, "data_source", "") or "")
    if source:
        task["data_source"] = source
    return task


class MultiTurn:
    """Plays trajectories on one inference engine (its ``Turns``), episodes built from the config's
    ``env`` section (``EnvSetup``), or hosted by the env role's workers through ``client``.
    ``cfg``: the run's config."""

    def __init__(self, cfg: RLBatchConfig, tokenizer: PreTrainedTokenizerBase, barrier: bool = False,
                 client: EnvClient | None = None) -> None:
        self.client = client
        self.setup = EnvSetup(cfg) if client is None else None  # the workers build their own
        self.tokenizer = tokenizer
        env, model = cfg.env, cfg.model
        self.observations: Observations = PlainText(self.encode)
        if cfg.data.chat_template:
            self.observations = ChatTurns(tokenizer, env.observation_role, cfg.data.system_prompt,
                                          model.path or "the tokenizer")
        budget = env.max_context_tokens
        if budget is None and not model.path:  # a random-init model's longest sequence
            budget = model.max_position_embeddings
        self.max_context = budget
        self.barrier = barrier
        """Every trajectory's turn, then every env step (``Rollout``'s baseline, for benchmarks)."""
        self.last: Rollout | None = None
        """The last rollout (its ``timeline``), for benchmarks."""

    def encode(self, text: str) -> list[int]:
        """An observation's tokens: the text alone, no special tokens (a BOS mid-trajectory would
        read as a new sequence)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        """A turn's action as the env reads it: special tokens kept, so an env can tell a turn that
        stopped (its EOS) from one cut at max_new_tokens (``rlbatch.rewards.extract_answer``)."""
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False))

    def __call__(self, engine: InferenceEngine | Turns, prompts: list[list[int]], params: SamplingParams,
                 tasks: Sequence[Task], seeds: list[int], seed: int,
                 ids: list[int] | None = None) -> list[Trajectory]:
        """One trajectory per sample, in order: ``prompts`` the task prompts' tokens (a BOS, or
        empty: the first observation is then the whole prompt), ``tasks`` and ``seeds`` what each
        episode starts from, ``seed`` the rollout's sampling seed, ``ids`` the samples' ids in the
        run (which env worker hosts each; by default their order here)."""
        ids = list(range(len(prompts))) if ids is None else ids
        starts = [Start(k, list(p), self._episode(sid), task, int(s))
                  for k, (p, task, s, sid) in enumerate(zip(prompts, tasks, seeds, ids, strict=True))]
        rollout = Rollout(engine if _is_turns(engine) else turns_of(engine), self.observations, self.decode, params, self.max_context,
                          workers=max(1, min(32, len(starts))), barrier=self.barrier)
        self.last = rollout
        return rollout.run(starts, seed)

    def _episode(self, sample_id: int) -> EpisodeHandle:
        if self.client is not None:
            return self.client.episode(worker_of(sample_id, self.client.size))
        assert self.setup is not None
        return self.setup.episode()


def _is_turns(engine: InferenceEngine | Turns) -> TypeIs[Turns]:
    """What ``turns_of`` takes as it is: an engine, or a ``Lockstep``, with submit, poll and in_flight."""
    return all(callable(getattr(engine, m, None)) for m in ("submit", "poll", "in_flight"))


def sample_fields(traj: Trajectory) -> dict[str, torch.Tensor]:
    """A trajectory as the sample the trainer reads (``rlbatch.phases``: the fields generate writes)."""
    return {"prompt": torch.tensor(traj.prompt, dtype=torch.long),
            "response": torch.tensor(traj.response, dtype=torch.long),
            "behaviour_logprobs": torch.tensor(traj.logprobs, dtype=torch.float32),
            "loss_mask": torch.tensor(traj.loss_mask, dtype=torch.float32)}


class TrajectorySummary(TypedDict):
    """What the controller gets back for one trajectory (``summary``)."""

    reward: float
    turns: int
    end: str
    generated: int
    observed: int
    env_seconds: float
    tool_calls: dict[str, int]
    spans: list[tuple[int, int]]
    """The generated runs of the response (``spans``)."""
    turn_rewards: list[tuple[int, float]]
    """The non-zero per-turn env rewards as (index among the generated tokens of the last token of
    the turn the reward followed, reward)."""
    worker: int | None
    """The env worker that hosted the episode; None: this rank's threads."""
    detail: str
    """What ended it, in words ('' when it ended well)."""


def summary(traj: Trajectory) -> TrajectorySummary:
    """What the controller gets back for one trajectory (small: a few numbers and names)."""
    info = traj.info or {}
    return {"reward": traj.reward, "turns": traj.turns, "end": traj.end, "generated": traj.generated,
            "observed": traj.observed, "env_seconds": float(info.get("env_seconds", 0.0)),
            "tool_calls": dict(info.get("tool_calls") or {}), "spans": spans(traj.loss_mask),
            "turn_rewards": [(n - 1, r) for n, r in zip(traj.reward_at, traj.rewards, strict=True) if n > 0 and r],
            "worker": info.get("worker"), "detail": str(info.get("detail") or "")}


def spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """The generated runs of a response as (start, length) pairs: its loss_mask, compactly."""
    out: list[tuple[int, int]] = []
    for i, m in enumerate(loss_mask):
        if m and out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        elif m:
            out.append((i, 1))
    return out


def action_masks(episodes: Mapping[int, TrajectorySummary], ids: list[int], lengths: list[int]) -> list[torch.Tensor] | None:
    """Each sample's loss_mask, rebuilt on the controller from its trajectory summary's ``spans``
    (``rlbatch.algos.advantages.Actions``); None for single-turn samples (no episodes)."""
    if not episodes:
        return None
    masks = []
    for sid, n in zip(ids, lengths, strict=True):
        m = torch.zeros(n, dtype=torch.bool)
        for start, length in episodes[sid]["spans"]:
            m[start : start + length] = True
        masks.append(m)
    return masks


def turn_rewards_of(episodes: Mapping[int, TrajectorySummary], ids: list[int]) -> list[list[tuple[int, float]]] | None:
    """Each sample's non-zero per-turn env rewards as (action index, reward): the index among its
    generated tokens of the last token of the turn the reward followed (``Actions``); None for
    single-turn samples."""
    if not episodes:
        return None
    return [[(int(i), float(r)) for i, r in episodes[sid].get("turn_rewards", ())] for sid in ids]


FAILED_ENDS = ("error", "invalid", "timeout")
"""End reasons of a trajectory its env failed: it raised, answered outside the contract, or
outlived ``env.step_timeout_s``."""


def all_failed(episodes: Mapping[int, TrajectorySummary]) -> str | None:
    """When every trajectory of a generation round ended in a failure of its env (``FAILED_ENDS``),
    the reason to stop the run, with the first failure's words; None otherwise. Training on such a
    round learns nothing (every reward 0) and would hide an env that cannot run (env.args it
    refuses, a service it cannot reach)."""
    if not episodes or any(e["end"] not in FAILED_ENDS for e in episodes.values()):
        return None
    first = min(episodes)
    ends = Counter(str(e["end"]) for e in episodes.values())
    return (f"every trajectory of the round ({len(episodes)}) ended in a failure of env.name's environment "
            f"({', '.join(f'{n} {r}' for r, n in sorted(ends.items()))}); the first (sample {first}): "
            f"{episodes[first]['end']}: {episodes[first].get('detail') or 'no detail'}")


def trajectory_stats(episodes: Mapping[int, TrajectorySummary]) -> dict[str, float]:
    """A step's trajectory metrics: turns per trajectory (mean, max), env seconds (summed over
    trajectories: time inside env and tool calls, which overlaps generation), tokens generated vs
    observed, the share of trajectories by end reason and the tool calls by outcome."""
    if not episodes:
        return {}
    eps = list(episodes.values())
    n = len(eps)
    turns = [int(e["turns"]) for e in eps]
    ends = Counter(str(e["end"]) for e in eps)
    calls: Counter[str] = Counter()
    for e in eps:
        calls.update({str(k): int(v) for k, v in (e.get("tool_calls") or {}).items()})
    out = {"env/turns_mean": sum(turns) / n, "env/turns_max": float(max(turns)),
           "env/seconds": float(sum(float(e["env_seconds"]) for e in eps)),
           "env/reward_mean": sum(float(e["reward"]) for e in eps) / n,
           "tokens/generated": float(sum(int(e["generated"]) for e in eps)),
           "tokens/observed": float(sum(int(e["observed"]) for e in eps))}
    out |= {f"env/end/{r}": ends.get(r, 0) / n for r in END_REASONS}
    out |= {f"env/tool_calls/{o}": float(calls.get(o, 0)) for o in TOOL_OUTCOMES}
    # the share of trajectories that called a tool at all, and that got a tool's output back
    out["env/tool_call_rate"] = sum(1 for e in eps if any((e.get("tool_calls") or {}).values())) / n
    out["env/tool_call_ok_rate"] = sum(1 for e in eps if (e.get("tool_calls") or {}).get("ok", 0)) / n
    hosts = [e.get("worker") for e in eps]
    if any(h is not None for h in hosts):  # an env role: the share hosted there and how many workers did
        out |= {"env/hosted_frac": sum(h is not None for h in hosts) / n,
                "env/hosts": float(len({h for h in hosts if h is not None}))}
    return out
