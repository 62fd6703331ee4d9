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
step s while step s+k generates. (With ``algo.in_flight_updates`` the weights land during that
generation, and the controller collects the inference ranks' answer to the sync later:
``Pipeline.settle``, which a checkpoint's part here waits for first.) Before that generation
starts, the ranks that work on step s's samples (trainer, reference, critic, scorers) take them off
the inference ranks, so none of their phases waits on a rank that is generating.

Generation runs ahead past the run's last step as well (k generations the run does not train
on), so that a finished run extended with a larger ``steps`` continues exactly as if it had been
one run. A checkpoint at the end of step s holds the generations of steps s+1 .. s+k that are not
trained yet (tokens, behaviour log-probs, the policy version that generated them) in ``rollouts.pt``, and
the data position after their prompts; resume puts them back on an inference rank and goes on.
Rewards are computed when a step takes its samples, so none are buffered.

With ``algo.partial_rollouts`` the inference engine keeps its samples across steps: generation
runs one step ahead, each generate command adds the next step's prompts to the samples the engine
holds and answers with the first ``prompts_per_step`` whole groups to finish, whichever step's
prompts they are; the longer samples stay in flight, under the weights that land meanwhile, for a
later step (``max_staleness`` >= 2 bounds how long; docs/async.md, "Partial rollouts"). The samples
in flight are part of a checkpoint: each inference worker's engine state (``KeptState``: every kept
sample's prompt, tokens so far, their log-probs and versions) with the controller's map of them
(answer, data source) and the next step whose prompts go in; resume puts them back on the same
workers, and the next generate command goes on with them as the uninterrupted run does.

The reference is frozen, so its log-probs of a generation do not depend on when they are taken.
Where the reference's ranks are the inference ranks (each of its shards inside one inference
worker), they are taken there right after each generation, queued behind it (``Rider``): the
trainer receives them with the samples and never waits for them. On other ranks the reference
works when the step takes its samples, as in the synchronous loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from rlbatch.checkpoint.files import ControllerState
from rlbatch.checkpoint.store import CheckpointError
from rlbatch.config.schema import RLBatchConfig
from rlbatch.data.synthetic import PromptStream
from rlbatch.loop.controller import Kept, PendingPhase, PendingRollouts, Pipeline, Role, Rollouts, split_even
from rlbatch.loop.partial import KeptState
from rlbatch.loop.scoring import Scoring
from rlbatch.phases import TRAJECTORY_FIELDS, phase_for

ROLLOUTS_FILE = "rollouts.pt"
KEPT_FILE = "kept.pt"
"""Partial rollouts: the samples in flight on the inference workers at a checkpoint."""


@dataclass
class Rider:
    """A role whose log-probs of each generation are taken on the inference ranks right after it
    (the frozen reference): ``on`` maps each inference worker to the role's shards on its ranks."""

    role: Role
    on: dict[tuple[int, ...], list[tuple[int, ...]]]

    @property
    def field(self) -> str:
        return phase_for(self.role.name, "logprobs").writes[0]

    def start(self, gen: PendingRollouts) -> tuple[PendingPhase, dict[tuple[int, ...], list[int]]]:
        """Queue the log-probs of ``gen``'s samples behind it on its ranks: each worker's samples
        split evenly over the shards on the worker (every rank of a worker holds its samples)."""
        assign = {sh: part for worker, ids in gen.ids_of.items()
                  for sh, part in zip(self.on[worker], split_even(ids, len(self.on[worker])), strict=True)}
        return self.role.start_logprobs_held(assign), assign


def rider_for(infer: Role, reference: Role | None) -> Rider | None:
    """The reference as a ``Rider`` when its ranks are the inference ranks and each of its shards
    lies inside one inference worker; else None (it works where it is placed)."""
    if reference is None or set(reference.ranks) != set(infer.ranks):
        return None
    on: dict[tuple[int, ...], list[tuple[int, ...]]] = {tuple(w): [] for w in infer.placement.workers}
    for sh in reference.shards:
        worker = next((w for w in on if set(sh) <= set(w)), None)
        if worker is None:
            return None
        on[worker].append(sh)
    return Rider(reference, on) if all(on.values()) else None


def async_plan(pipe: Pipeline, infer: Role, reference: Role | None, k: int) -> tuple[int, Rider | None]:
    """The staleness the run can use, and the reference riding on the inference ranks (or None).

    ``k``, or 0 (with a one-line note) when actor_infer shares ranks with another GPU role whose
    phases would wait for its generation. The reference (given when its log-probs are used) may
    share them when it can ride along (``rider_for``)."""
    if k == 0:
        return 0, None
    rider = rider_for(infer, reference)
    ranks = set(pipe.world.members["actor_infer"])
    shared = sorted(r for r, rp in pipe.p.roles.items()
                    if r != "actor_infer" and rp.is_gpu and ranks & set(pipe.world.members.get(r, ()))
                    and not (rider is not None and r == rider.role.name))
    if shared:
        why = (" (the reference takes its log-probs beside the generation only when its ranks are actor_infer's "
               "and each of its shards lies inside one inference worker)" if reference is not None
               and reference.name in shared else "")
        print(f"algo.max_staleness={k}: actor_infer shares its ranks with {', '.join(shared)}, so generation "
              f"cannot run alongside their phases: this run trains synchronously (max_staleness 0){why}", flush=True)
        return 0, None
    return k, rider


def staleness_of(ro: Rollouts, version: int) -> dict[int, int]:
    """Each sample's staleness when trained at policy ``version``: the versions between the weights
    that sampled its oldest token and ``version``."""
    return {sid: version - ro.oldest(sid) for sid in ro.ids}


def past_the_bound(ro: Rollouts, version: int, k: int) -> list[int]:
    """The samples to leave out of a batch trained at policy ``version`` with ``algo.max_staleness
    = k``: every sample of a group one of whose samples has a token older than ``version - k``
    (a group's samples are compared with one another, so a group goes whole)."""
    stale = staleness_of(ro, version)
    n = max(ro.group_size, 1)
    groups = [ro.ids[i : i + n] for i in range(0, len(ro.ids), n)]
    return [sid for g in groups if any(stale[sid] > k for sid in g) for sid in g]


def without(ro: Rollouts, dropped: list[int]) -> Rollouts:
    """``ro`` without the samples ``dropped`` (whole groups, so the rest stay in group order)."""
    if not dropped:
        return ro
    gone = set(dropped)
    keep = [i for i, sid in enumerate(ro.ids) if sid not in gone]
    return replace(ro, ids=[ro.ids[i] for i in keep], answers=[ro.answers[i] for i in keep],
                   sources=[ro.sources[i] for i in keep] if ro.sources else [])


def staleness_stats(ro: Rollouts, version: int, k: int) -> dict[str, float]:
    """The batch's staleness by each sample's oldest token, checked against ``k``: min, mean and max
    over its samples (``staleness`` is the mean), and the share of samples whose tokens come from
    more than one policy version (weights loaded mid-generation)."""
    stale = staleness_of(ro, version)
    bad = {sid: s for sid, s in stale.items() if not 0 <= s <= k}
    if bad:
        sid, s = next(iter(bad.items()))
        raise RuntimeError(f"sample {sid}'s oldest token was generated by policy version {ro.oldest(sid)} and would "
                           f"train version {version}: staleness {s} is outside [0, algo.max_staleness={k}] "
                           f"({len(bad)} of {len(stale)} samples)")
    values = list(stale.values()) or [version - ro.version]
    mixed = sum(1 for sid in ro.ids if sid in ro.versions and ro.versions[sid][0] != ro.versions[sid][1])
    return {"staleness": sum(values) / len(values), "staleness_min": float(min(values)),
            "staleness_max": float(max(values)), "mixed_version_frac": mixed / max(len(ro.ids), 1)}


class Ahead:
    """A step's generation under way, and the rider's log-probs queued behind it (with partial
    rollouts, whose samples are known only once the generation answers, queued then)."""

    def __init__(self, gen: PendingRollouts, rider: Rider | None) -> None:
        self.gen = gen
        self.rider = rider
        self.riding = (rider, *rider.start(gen)) if rider is not None and gen.kept is None else None

    def result(self) -> Rollouts:
        ro = self.gen.result()
        if self.rider is not None and self.gen.kept is not None and self.riding is None:
            self.riding = (self.rider, *self.rider.start(self.gen))
            self.rider = None
        if self.riding is not None:
            rider, pending, assign = self.riding
            pending.result()
            rider.role.record(phase_for(rider.role.name, "logprobs"), assign)
            self.riding = None
        return ro


class GenerationQueue:
    """The generations started and not yet trained on, by step; ``take(step)`` hands out a step's
    rollouts (with scoring started) and keeps ``k`` steps generating ahead. ``partial``
    (``algo.partial_rollouts``): one step ahead, with the engine keeping samples across steps."""

    def __init__(self, actor_infer: Role, consumers: list[Role], scoring: Scoring, data: PromptStream,
                 cfg: RLBatchConfig, k: int,
                 rider: Rider | None = None, partial: bool = False) -> None:
        self.infer, self.scoring, self.data = actor_infer, scoring, data
        self.k, self.rider = k, rider
        self.consumers = [c for c in consumers if rider is None or c is not rider.role]
        self.also = (rider.field,) if rider is not None else ()
        """Fields made on the inference ranks beside the generated ones (the rider's)."""
        self.prompts, self.n, self.seed = int(cfg.algo.prompts_per_step), int(cfg.algo.samples_per_prompt), int(cfg.seed)
        self.kept: Kept | None = {} if partial and k > 0 else None
        """Partial rollouts: the samples started and not yet returned (``Role.start_generate``)."""
        self.depth = 1 if self.kept is not None else k
        """Steps generated ahead: ``k``, or with partial rollouts 1 (the rest of the bound is the time
        a sample may stay in flight across steps)."""
        self.submitted = 0
        """Partial rollouts: the step whose prompts go into the engine next (prompts run a step
        ahead of the generation that returns a step's batch, so the engine always holds more
        samples than one batch: a long one stays behind while shorter ones fill the batch)."""
        self.ahead: dict[int, Ahead | Rollouts] = {}
        self.unridden: set[int] = set()
        """Restored steps whose samples lack the rider's field (saved by a run where it did not ride)."""
        self.version = 0
        """The policy version the inference engine holds (actor updates synced to it)."""
        self.dropped = 0
        """Samples the last ``take`` left out: a token of theirs was older than ``k`` versions."""

    def _start(self, step: int) -> None:
        per_step = self.prompts * self.n
        seed = self.seed * 100_003 + step
        if self.kept is None:
            gen = self.infer.start_generate(self.data.next_batch(self.prompts), self.n, first_id=step * per_step,
                                            seed=seed, version=self.version)
        else:  # the prompts up to step + 1's into the engine (at the start two steps'), one step's groups out
            first = max(self.submitted, step)
            prompts = [s for _ in range(first, step + 2) for s in self.data.next_batch(self.prompts)]
            self.submitted = step + 2
            gen = self.infer.start_generate(prompts, self.n, first_id=first * per_step, seed=seed,
                                            version=self.version, kept=self.kept, take=self.prompts)
        self.ahead[step] = Ahead(gen, self.rider)

    def take(self, step: int, behind: Callable[[], None] | None = None) -> Rollouts:
        """Step ``step``'s rollouts, their scoring started (``scoring.result()`` waits). ``behind``:
        more work to queue on the inference ranks (a held-out evaluation), started once the step's
        samples are on their way off them, as before a generation ahead, so that no phase of the
        step waits for it there."""
        for j in range(step, step + max(self.depth, 1)):  # start-up: steps step .. step+depth-1
            if j not in self.ahead:
                self._start(j)
        got = self.ahead.pop(step)
        rollouts = self._within_bound(step, got if isinstance(got, Rollouts) else got.result())
        if step in self.unridden and self.rider is not None:  # restored from a checkpoint without them
            self.rider.role.logprobs(rollouts)
        if self.k == 0 and behind is None:
            self.scoring.start(rollouts)
            return rollouts
        moving: list[PendingPhase] = [role.receive(rollouts, self.also) for role in self.consumers]
        self.scoring.start(rollouts)
        if self.depth:
            self._start(step + self.depth)  # past the last step too: a run extended later goes on exactly
        if behind is not None:
            behind()
        for m in moving:
            m.result()
        return rollouts

    def _within_bound(self, step: int, ro: Rollouts) -> Rollouts:
        """``ro`` without the groups that hold a sample past the staleness bound at the version the
        step trains (the one the engine holds: the trainer's); they are dropped on their ranks and
        counted (``dropped``, the step's ``train/stale_dropped``)."""
        dropped = past_the_bound(ro, self.version, self.k)
        self.dropped = len(dropped)
        if not dropped:
            return ro
        if len(dropped) == len(ro.ids):
            raise RuntimeError(f"step {step}: every one of its {len(ro.ids)} samples has a token older than "
                               f"algo.max_staleness={self.k} policy versions before version {self.version} "
                               f"(oldest: version {min(ro.oldest(s) for s in ro.ids)}); nothing is left to train on")
        print(f"step {step}: {len(dropped)} of {len(ro.ids)} samples dropped, a token of their group older than "
              f"algo.max_staleness={self.k} versions", flush=True)
        self.infer.pipe.forget(dropped)
        return without(ro, dropped)

    def synced(self, version: int) -> None:
        self.version = version

    # --- checkpoint part: the generations not trained on yet --------------------------------------

    def save(self, stage: Path) -> ControllerState:
        """Write the generations of the steps after this one into ``stage``; the controller's state.
        First every outstanding answer (an in-flight sync's, ``Pipeline.settle``; the loop settles
        before the checkpoint starts, this keeps any other caller to it): a checkpoint holds only
        what every rank has confirmed."""
        self.infer.pipe.settle()
        self._save_kept(stage)
        if not self.ahead:
            return {"policy_version": self.version}
        entries = []
        for step in sorted(self.ahead):
            got = self.ahead[step]
            ro = got if isinstance(got, Rollouts) else got.result()
            self.ahead[step] = ro
            names = [f for f in phase_for(self.infer.name, "buffer").writes if ro.episodes or f not in TRAJECTORY_FIELDS]
            samples = self._read(ro.ids, names)
            for name in self.also:  # where taken (a step restored without them has none to read)
                for sid, fields in self._read(ro.ids, [name]).items():
                    samples[sid].update(fields)
            entries.append({"step": step, "rollouts": asdict(ro), "samples": samples})
        torch.save({"max_staleness": self.k, "entries": entries}, stage / ROLLOUTS_FILE)
        return {"policy_version": self.version, "generations_ahead": len(entries)}

    def _save_kept(self, stage: Path) -> None:
        """Partial rollouts: the samples in flight on each inference worker (read from its first
        rank, after the generation before the checkpoint has answered), the controller's map of them
        and the next step whose prompts go in, into ``KEPT_FILE``."""
        if self.kept is None:
            return
        for got in self.ahead.values():  # the engines hold still only once the generate commands answered
            if not isinstance(got, Rollouts):
                got.result()
        leaders = [w[0] for w in self.infer.placement.workers]
        out = self.infer.pipe.run("rollout_buffer", (self.infer.name,), {r: {"op": "read_kept"} for r in leaders})
        workers: list[KeptState] = [out[r] for r in leaders]
        held = sorted(s["key"] for w in workers for s in w["samples"])
        if held != sorted(self.kept) or len(set(held)) != len(held):
            raise RuntimeError(f"partial rollouts: the inference workers hold samples {held[:8]}... ({len(held)}) and "
                               f"the controller expects {sorted(self.kept)[:8]}... ({len(self.kept)}): a checkpoint "
                               f"would lose or duplicate samples in flight")
        torch.save({"workers": workers, "kept": sorted(self.kept.items()), "submitted": self.submitted},
                   stage / KEPT_FILE)

    def _load_kept(self, ckpt: Path) -> None:
        """Put back what ``_save_kept`` wrote: each worker's samples onto the same worker (every rank
        of it), the map of them, and the next step whose prompts go in."""
        path = ckpt / KEPT_FILE
        if self.kept is None or not path.is_file():
            if path.is_file():
                raise CheckpointError(f"{path}: this checkpoint holds samples in flight of a run with "
                                      f"algo.partial_rollouts=true; resume with it (they would otherwise be lost)")
            return
        saved = torch.load(path)
        workers = self.infer.placement.workers
        if len(saved["workers"]) != len(workers):
            raise CheckpointError(f"{path}: samples in flight on {len(saved['workers'])} inference workers; this run "
                                  f"has {len(workers)} (roles.actor_infer): resume on the same placement")
        work = {r: {"op": "restore_kept", "kept": state} for w, state in zip(workers, saved["workers"], strict=True)
                for r in w}
        self.infer.pipe.run("rollout_buffer", (self.infer.name,), work)
        self.kept.clear()
        self.kept.update((int(sid), (str(a), str(src))) for sid, (a, src) in saved["kept"])
        self.submitted = int(saved["submitted"])

    def _read(self, ids: list[int], names: list[str]) -> dict[int, dict[str, torch.Tensor]]:
        """The fields ``names`` of the samples ``ids`` that have the first of them, each read from
        a rank that holds it."""
        holders: dict[int, list[int]] = {}
        for sid, rank in self.infer.pipe.holder(ids, names[0]).items():
            holders.setdefault(rank, []).append(sid)
        if not holders:
            return {}
        out = self.infer.pipe.run("rollout_buffer", (self.infer.name,),
                                  {r: {"op": "read", "ids": held, "fields": names} for r, held in holders.items()})
        return {sid: fields for part in out.values() for sid, fields in part.items()}

    def load(self, ckpt: Path, state: ControllerState) -> None:
        """Restore what ``save`` wrote: the version, and the buffered generations onto the first
        inference worker (the ranks that train them take them from there, as from any worker)."""
        self.version = int(state.get("policy_version", 0))
        self._load_kept(ckpt)
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
            self.submitted = max(self.submitted, int(entry["step"]) + 1)
            if self.rider is not None and any(self.rider.field not in f for f in entry["samples"].values()):
                self.unridden.add(int(entry["step"]))
