"""One step's batch of rollouts: a single generation round, or DAPO's dynamic sampling.

Dynamic sampling (``algo.dynamic_sampling``) generates and scores rounds of ``prompts_per_step``
prompts until the batch holds ``prompts_per_step`` groups whose rewards differ (a group whose
samples all got the same reward gives a group-relative estimator nothing to learn from), or
``algo.max_sampling_rounds`` rounds ran. A batch still short at the cap is filled with
zero-variance groups, so every step trains on the same number of samples. Groups left over are
dropped from the ranks that hold them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlbatch.algos.advantages import zero_variance_groups
from rlbatch.config.schema import AlgoConfig
from rlbatch.data.synthetic import PromptStream
from rlbatch.loop.controller import Role, Rollouts
from rlbatch.loop.scoring import Scoring


@dataclass
class GroupPicker:
    """Which generated groups make the batch: varied groups first (in generation order), then
    zero-variance ones to fill it. Pure bookkeeping over group indices."""

    wanted: int
    varied: list[int] = field(default_factory=list)
    flat: list[int] = field(default_factory=list)
    rounds: int = 0

    def add_round(self, first_group: int, zero_variance: list[bool]) -> None:
        self.rounds += 1
        for k, zero in enumerate(zero_variance):
            (self.flat if zero else self.varied).append(first_group + k)

    @property
    def full(self) -> bool:
        return len(self.varied) >= self.wanted

    def picked(self) -> list[int]:
        """The batch's groups in generation order: ``wanted`` of them when enough were generated."""
        chosen = self.varied[: self.wanted]
        chosen += self.flat[: self.wanted - len(chosen)]
        return sorted(chosen)

    def stats(self) -> dict[str, float]:
        generated = len(self.varied) + len(self.flat)
        return {"sampling/rounds": float(self.rounds), "sampling/groups_generated": float(generated),
                "sampling/zero_variance_frac": len(self.flat) / max(generated, 1),
                "sampling/zero_variance_in_batch": float(max(self.wanted - len(self.varied), 0))}


def select(parts: list[tuple[Rollouts, torch.Tensor]], groups: list[int]) -> tuple[Rollouts, torch.Tensor, list[int]]:
    """The rollouts and rewards of ``groups`` (indices over all parts' groups, in order), and the
    ids of every other sample."""
    ids: list[int] = []
    answers: list[str] = []
    sources: list[str] = []
    rewards: list[torch.Tensor] = []
    plen: dict[int, int] = {}
    rlen: dict[int, int] = {}
    keep, n, base = set(groups), parts[0][0].group_size, 0
    dropped: list[int] = []
    for ro, r in parts:
        for g in range(len(ro.ids) // n):
            sl = slice(g * n, (g + 1) * n)
            if base + g in keep:
                ids += ro.ids[sl]
                answers += ro.answers[sl]
                sources += ro.sources[sl] if ro.sources else [""] * n
                rewards.append(r[sl])
            else:
                dropped += ro.ids[sl]
        base += len(ro.ids) // n
        plen |= ro.prompt_len
        rlen |= ro.response_len
    episodes = {i: e for ro, _ in parts for i, e in ro.episodes.items()}
    kept = Rollouts(ids, answers, n, {i: plen[i] for i in ids}, {i: rlen[i] for i in ids}, parts[0][0].version,
                    sources, {i: episodes[i] for i in ids if i in episodes})
    return kept, torch.cat(rewards), dropped


def dynamic_batch(actor_infer: Role, scoring: Scoring, data: PromptStream, step: int, seed: int, algo: AlgoConfig,
                  version: int) -> tuple[Rollouts, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rounds of generate + score until ``prompts_per_step`` varied groups (or the round cap).

    Returns the batch's rollouts and rewards, the rewards of every sample generated (the policy's
    unfiltered reward: the batch's own is biased, as all-right groups are left out) and stats.
    ``version``: the policy version the inference engine holds."""
    p, n = int(algo.prompts_per_step), int(algo.samples_per_prompt)
    cap = int(algo.max_sampling_rounds)
    picker = GroupPicker(p)
    parts: list[tuple[Rollouts, torch.Tensor]] = []
    counts: dict[str, float] = {}
    while not picker.full and picker.rounds < cap:
        k = picker.rounds
        ro = actor_infer.generate(data.next_batch(p), n, first_id=(step * cap + k) * p * n,
                                  seed=seed * 100_003 + step * cap + k, version=version)
        scoring.start(ro)
        rewards, round_counts = scoring.result()
        for k2, v in round_counts.items():
            counts[k2] = counts.get(k2, 0) + v
        picker.add_round(k * p, zero_variance_groups(rewards, n).tolist())
        parts.append((ro, rewards))
    rollouts, rewards, dropped = select(parts, picker.picked())
    actor_infer.pipe.forget(dropped)
    return rollouts, rewards, torch.cat([r for _, r in parts]), picker.stats() | counts
