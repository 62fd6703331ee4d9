"""Generation ahead of training: asynchronous off-policy RL on a disaggregated placement.

With ``algo.max_staleness = k > 0`` the generation of step s + k starts as soon as step s's
rollouts are in hand, before step s trains, on the inference ranks and with the weights they
hold. The schedule depends on the step numbers alone, so a run is reproducible and a resumed run
continues the uninterrupted one bitwise:

    the generation of step j starts at step j - k (all of steps 0 .. k-1 at the start)
    with the policy after j - k updates (version max(0, j - k) in the policy-gradient loop)
    so step j trains on samples min(j, k) versions old

The inference ranks run their commands in order: ..., generate(s+k), sync(s), ...: a weight sync
waits for the generation started before it and never interrupts one, and the trainer trains
step s while step s+k generates. Before that generation starts, the ranks that work on step s's
samples (trainer, reference, critic, scorers) take them off the inference ranks, so none of their
phases waits on a rank that is generating.

Generation runs ahead past the run's last step as well (k generations the run does not train
on), so that a finished run extended with a larger ``steps`` continues exactly as if it had been
one run. A checkpoint at the end of step s holds the generations of steps s+1 .. s+k that are not
trained yet (tokens, behaviour log-probs, the policy version that generated them) in ``rollouts.pt``, and
the data position after their prompts; resume puts them back on an inference rank and goes on.
Rewards are computed when a step takes its samples, so none are buffered.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rlbatch.checkpoint.store import CheckpointError
from rlbatch.scheduler.controller import Generation, PendingPhase, Pipeline, Role, Rollouts
from rlbatch.scheduler.scoring import Scoring

ROLLOUTS_FILE = "rollouts.pt"


def async_staleness(pipe: Pipeline, k: int) -> int:
    """The staleness the run can use: ``k``, or 0 (with a one-line note) when actor_infer shares
    ranks with another GPU role, whose phases would wait for its generation."""
    if k == 0:
        return 0
    infer = set(pipe.world.members["actor_infer"])
    shared = sorted(r for r, rp in pipe.p.roles.items()
                    if r != "actor_infer" and rp.is_gpu and infer & set(pipe.world.members.get(r, ())))
    if shared:
        print(f"algo.max_staleness={k}: actor_infer shares its ranks with {', '.join(shared)}, so generation "
              f"cannot run alongside their phases: this run trains synchronously (max_staleness 0)", flush=True)
        return 0
    return k


class GenerationQueue:
    """The generations started and not yet trained on, by step; ``take(step)`` hands out a step's
    rollouts (with scoring started) and keeps ``k`` steps generating ahead."""

    def __init__(self, actor_infer: Role, consumers: list[Role], scoring: Scoring, data: Any, cfg: Any, k: int) -> None:
        self.infer, self.consumers, self.scoring, self.data = actor_infer, consumers, scoring, data
        self.k = k
        self.prompts, self.n, self.seed = int(cfg.algo.prompts_per_step), int(cfg.algo.samples_per_prompt), int(cfg.seed)
        self.ahead: dict[int, Generation | Rollouts] = {}
        self.version = 0
        """The policy version the inference engine holds (actor updates synced to it)."""

    def _start(self, step: int) -> None:
        per_step = self.prompts * self.n
        self.ahead[step] = self.infer.start_generate(self.data.next_batch(self.prompts), self.n,
                                                     first_id=step * per_step, seed=self.seed * 100_003 + step,
                                                     version=self.version)

    def take(self, step: int) -> Rollouts:
        """Step ``step``'s rollouts, their scoring started (``scoring.result()`` waits)."""
        for j in range(step, step + max(self.k, 1)):  # start-up: steps step .. step+k-1
            if j not in self.ahead:
                self._start(j)
        got = self.ahead.pop(step)
        rollouts = got if isinstance(got, Rollouts) else got.result()
        if self.k == 0:
            self.scoring.start(rollouts)
            return rollouts
        moving: list[PendingPhase] = [role.receive(rollouts) for role in self.consumers]
        self.scoring.start(rollouts)
        self._start(step + self.k)  # past the last step too: a run extended later goes on exactly
        for m in moving:
            m.result()
        return rollouts

    def synced(self, version: int) -> None:
        self.version = version

    # --- checkpoint part: the generations not trained on yet --------------------------------------

    def save(self, stage: Path) -> dict[str, Any]:
        """Write the generations of the steps after this one into ``stage``; the controller's state."""
        if not self.ahead:
            return {"policy_version": self.version}
        entries = []
        for step in sorted(self.ahead):
            got = self.ahead[step]
            ro = got if isinstance(got, Rollouts) else got.result()
            self.ahead[step] = ro
            holders: dict[int, list[int]] = {}
            for sid, rank in self.infer.pipe.holder(ro.ids).items():
                holders.setdefault(rank, []).append(sid)
            out = self.infer.pipe.run("rollout_buffer", (self.infer.name,),
                                      {r: {"op": "read", "ids": ids} for r, ids in holders.items()})
            samples = {sid: fields for part in out.values() for sid, fields in part.items()}
            entries.append({"step": step, "rollouts": asdict(ro), "samples": samples})
        torch.save({"max_staleness": self.k, "entries": entries}, stage / ROLLOUTS_FILE)
        return {"policy_version": self.version, "generations_ahead": len(entries)}

    def load(self, ckpt: Path, state: dict[str, Any]) -> None:
        """Restore what ``save`` wrote: the version, and the buffered generations onto the first
        inference worker (the ranks that train them take them from there, as from any worker)."""
        self.version = int(state.get("policy_version", 0))
        path = ckpt / ROLLOUTS_FILE
        if not path.is_file():
            return
        saved = torch.load(path)
        if int(saved["max_staleness"]) != self.k:
            raise CheckpointError(
                f"{path}: this checkpoint holds {len(saved['entries'])} generations made ahead with "
                f"algo.max_staleness={saved['max_staleness']}; this run has algo.max_staleness={self.k}. Resume with "
                f"algo.max_staleness={saved['max_staleness']} (the buffered samples would otherwise be dropped or "
                f"trained staler than allowed)")
        leader = self.infer.placement.workers[0][0]
        pipe = self.infer.pipe
        samples = {sid: fields for entry in saved["entries"] for sid, fields in entry["samples"].items()}
        pipe.run("rollout_buffer", (self.infer.name,), {leader: {"op": "restore", "samples": samples}})
        for sid, fields in samples.items():
            for name, value in fields.items():
                pipe.produced(leader, sid, name, len(value))
        for entry in saved["entries"]:
            self.ahead[int(entry["step"])] = Rollouts(**entry["rollouts"])
