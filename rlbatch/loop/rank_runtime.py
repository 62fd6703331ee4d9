"""A rank's side of the pipeline: its engines, its samples, and one operation per kind of phase.

The controller sends ``phase`` commands; each carries the data moves this rank takes part in
and, when this rank works in the phase, the work itself. Moves happen first (rank to rank over
the data plane), then the phase's operation (``rlbatch.phases``: its ``op``, role and fields)
runs inside a residency switch that offloads colocated roles. Engines are built through the
registry and driven through the engine contract only (``rlbatch.engines.base``).
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypeAlias, TypedDict

import torch

from rlbatch.algos.advantages import response_loss_mask
from rlbatch.algos.objective import objective_for
from rlbatch.algos.registry import KL_ESTIMATORS
from rlbatch.config.schema import HEADS, TRAINABLE_ROLES, ModelConfig, RLBatchConfig, role_algo
from rlbatch.data.images import ProcessedImages, PromptEncoder, same_prompt
from rlbatch.engines.base import EngineContext, SamplingParams, build_engine
from rlbatch.engines.model import load_processor, load_tokenizer, model_dtype
from rlbatch.engines.registry import spec_of
from rlbatch.loop.controller import PhaseReply, Sampling
from rlbatch.loop.partial import KeptState, PartialRollouts
from rlbatch.loop.residency import Residency
from rlbatch.loop.scorers import build_scorer
from rlbatch.loop.weightsync import AdapterSink, InFlightSync, WeightBroadcast, landing, load_in_process
from rlbatch.phases import PHASES, PhaseSpec
from rlbatch.rewards import RewardError, Scorer
from rlbatch.rewards.model import ModelScorer
from rlbatch.runtime import heap
from rlbatch.runtime.dataplane import Move, SampleStore, exchange
from rlbatch.runtime.faults import DropFirst, fault_at, maybe_fault
from rlbatch.runtime.world import SYNC, World, as_collective_timeout

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlbatch.envs.base import Task
    from rlbatch.envs.trajectories import MultiTurn, TrajectorySummary
    from rlbatch.loop.samples import Shown

log = logging.getLogger(__name__)


class Service(Protocol):
    """What a rank serves to other ranks beside its command loop (``SERVICES``)."""

    def close(self) -> None: ...


Generated: TypeAlias = ("tuple[int, int, tuple[int, int]] | tuple[int, int, tuple[int, int], TrajectorySummary]"
                         " | tuple[int, int, tuple[int, int], None, dict[str, int], int]")
"""A sample generated, for the controller: (prompt length, response length, (oldest, newest) policy
version of its tokens), and in a run with an environment the trajectory's summary
(``rlbatch.envs.trajectories.summary``); for a prompt with images, no summary, the lengths of
its image fields (``rlbatch.phases.IMAGE_FIELDS``) and their key: the first sample of the phase with
the same prompt and images, whose field tensors it shares (the data plane moves them once)."""


def token_versions(versions: list[int], length: int, version: int) -> torch.Tensor:
    """The policy version of each of a response's ``length`` tokens: the engine's record, or, from an
    engine that records none, ``version`` (the one the generation started with) for every token."""
    if versions and len(versions) != length:
        raise RuntimeError(f"generate: the engine recorded {len(versions)} token versions for {length} tokens")
    return torch.tensor(versions or [version] * length, dtype=torch.long)


def version_span(versions: torch.Tensor, version: int) -> tuple[int, int]:
    """(oldest, newest) of a response's token versions; ``version`` for both when it has no token."""
    return (int(versions.min()), int(versions.max())) if versions.numel() else (version, version)


class ScoreOutput(TypedDict):
    """A scorer's part of a score phase on one rank."""

    rewards: dict[int, float]
    """Reward by sample id."""
    counts: dict[str, int]
    """The scorer's counts (for the step's metrics)."""
    shown: NotRequired[dict[int, Shown]]
    """The samples the controller asked to see, as text (``rlbatch.loop.samples``)."""


def role_model(role: str, cfg: RLBatchConfig, policy_tokenizer: PreTrainedTokenizerBase,
               ) -> tuple[ModelConfig, PreTrainedTokenizerBase]:
    """The model config and tokenizer a role's engine is built from: the policy's, but for a reward
    model of its own (``reward_model.path``, with its tokenizer) or a critic of its own
    (``critic_model.path``, reading the policy's tokens)."""
    if HEADS.get(role) == "reward" and cfg.reward_model.path:
        model = replace(cfg.model, path=str(cfg.reward_model.path))
        return model, load_tokenizer(model)
    if HEADS.get(role) == "value" and cfg.critic_model.path:
        return replace(cfg.model, path=str(cfg.critic_model.path)), policy_tokenizer
    return cfg.model, policy_tokenizer


def scorers(world: World, cfg: RLBatchConfig) -> dict[str, Scorer]:
    """This rank's CPU roles that score responses (phases whose op is ``score``), each with the
    scorer ``rlbatch.loop.scorers.SCORERS`` names for it."""
    return {spec.role: build_scorer(spec.role, cfg) for spec in PHASES.values()
            if spec.op == "score" and spec.role in world.roles and not world.placement.roles[spec.role].is_gpu}


SERVICES: dict[str, str] = {
    "env": "rlbatch.envs.host:serve_envs",
}
"""CPU role -> ``module:factory`` of what its processes serve beside the command loop, to other
ranks rather than to the controller (``factory(world, cfg)`` -> an object with ``close()``): the env
role's workers answer the inference ranks' episode requests."""


def services(world: World, cfg: RLBatchConfig) -> dict[str, Service]:
    """This rank's services, started: one per role of this rank that ``SERVICES`` names."""
    out: dict[str, Service] = {}
    for role in world.roles:
        if role in SERVICES:
            module, _, name = SERVICES[role].partition(":")
            out[role] = getattr(importlib.import_module(module), name)(world, cfg)
    return out


def build_order(world: World) -> list[str]:
    """This rank's GPU roles in the order their engines are built: engines that reserve a share of
    the device at start-up (``EngineSpec.reserves_device_share``: vLLM's gpu_memory_utilization)
    first, while the device is empty, the others in placement order. Every rank sorts the same
    role list the same way, so engines whose construction is collective still meet."""
    p = world.placement
    gpu = [role for role, _ in world.slot.roles if p.roles[role].is_gpu]
    return sorted(gpu, key=lambda r: not spec_of(p.roles[r].engine).reserves_device_share)


class RankRuntime:
    def __init__(self, world: World, cfg: RLBatchConfig) -> None:
        self.world, self.cfg = world, cfg
        self.store = SampleStore()
        self.tokenizer = load_tokenizer(cfg.model)
        self.image_prompts = PromptEncoder(self.tokenizer, lambda: load_processor(cfg.model, self.tokenizer))
        """A vision-language policy's prompts as token ids and image fields (``_generate_images``); its
        processor is built when the first prompt with images comes."""
        self.engines: dict[str, Any] = {}
        """This rank's engines by role, built by the registry (``build_engine``): each implements the
        contract of its kind (``rlbatch.engines.base``: ``InferenceEngine`` or ``TrainEngine``)."""
        p = world.placement
        self.scorers = scorers(world, cfg)
        self.multi_turn: MultiTurn | None = None
        """Episodes of a run with an environment (``rlbatch.envs.trajectories.MultiTurn``), once needed."""
        self.partial = PartialRollouts()
        """``algo.partial_rollouts``: the prompts of the samples the inference engine keeps across phases."""
        order = build_order(world)
        self.residency = Residency({r: p.roles[r].offload for r in order}, world.device)
        for role in order:
            rp = p.roles[role]
            model, tokenizer = role_model(role, cfg, self.tokenizer)
            ctx = EngineContext(role, rp.args, model, role_algo(role, cfg.algo),
                                tokenizer, world.device, int(cfg.seed), world.meshes.get(role),
                                role in TRAINABLE_ROLES, HEADS.get(role, "lm"),
                                {**({"role": world.groups[role]} if role in world.groups else {}),  # none without a torch world
                                 **world.subgroups.get(role, {})}, world.comm)
            self.engines[role] = build_engine(rp.engine, ctx)
            put_away = self.residency.add(role, self.engines[role])
            log.info("built %s engine for %s%s", rp.engine, role,
                     f"; offloaded until its first phase ({put_away.bytes} bytes)" if role in self.residency.offloadable else "")
            if ctx.head == "reward":
                self.scorers[role] = ModelScorer(self.engines[role], tokenizer, self.tokenizer, cfg)
        self.services = services(world, cfg)
        self.objectives = {r: objective_for(r, cfg.algo) for r in self.engines if r in TRAINABLE_ROLES}
        # Weights travel in the inference engine's dtype: every rank of the sync group derives it alike.
        self.broadcast = WeightBroadcast(model_dtype(str(cfg.model.dtype), world.device))
        self.in_flight = (InFlightSync(world, self.broadcast, min(world.members["actor_train"]), self._lockstep())
                          if cfg.algo.in_flight_updates and world.rank in world.members.get(SYNC, ()) else None)
        """``algo.in_flight_updates``: syncs land between the engine steps of a generation."""
        self.ops: dict[str, Callable[..., object]] = {"generate": self._generate, "score": self._score, "logprobs": self._logprobs,
                                    "base_logprobs": self._logprobs, "values": self._values, "train": self._train,
                                    "sync": self._sync, "checkpoint": self._checkpoint, "buffer": self._buffer}

    def _lockstep(self) -> tuple[int, ...]:
        """The ranks of this rank's inference worker (its tensor-parallel peers and itself) where
        their engines step in lockstep (``EngineSpec.in_flight_tp``) and must agree on the step an
        in-flight sync lands at; none elsewhere."""
        rp = self.world.placement.roles.get("actor_infer")
        if rp is None or spec_of(rp.engine).in_flight_tp != "lockstep":
            return ()
        return next((tuple(w) for w in rp.workers if self.world.rank in w), ())

    def handlers(self) -> dict[str, Callable[..., object]]:
        return {"phase": self.phase, "ready": self.ready, "shutdown": self.close}

    def close(self) -> None:
        """Before this rank acknowledges ``shutdown``: stop its services."""
        for service in self.services.values():
            service.close()

    def ready(self) -> None:
        """The engines are built: nothing long-lived is allocated after this."""
        frozen, secs = heap.settle()
        log.info("heap settled: %d objects frozen out of garbage collection in %.2fs", frozen, secs)
        tightened = self.world.tighten_timeouts()  # start-up is over: collectives wait cluster.timeout_s
        log.info("%d process groups now time out after %.0fs", tightened, self.world.timeout_s)

    def phase(self, phase: str, roles: tuple[str, ...], moves: list[Move], work: Mapping[str, object] | None,
              drop: list[int] | None = None, discard: dict[str, list[str]] | None = None) -> PhaseReply:
        # A phase still running here after cluster.timeout_s has, as a rule, outlived the
        # controller's wait for it (the run is ending): the rank's threads' stacks go to its log,
        # which tells a rank that hangs from one waiting in a collective for it. (A phase the
        # controller waits for only later, such as a generation ahead of training, may run longer
        # and leaves only this dump.) Cancelled when the phase returns.
        faulthandler.dump_traceback_later(self.world.timeout_s, exit=False)
        try:
            return self._phase(phase, roles, moves, work, drop, discard)
        except RuntimeError as e:
            peers = tuple(sorted({r for role in roles for r in self.world.members.get(role, ())} - {self.world.rank}))
            timed_out = as_collective_timeout(e, f"phase '{phase}' of {', '.join(roles)}", self.world.rank, peers,
                                              self.world.timeout_s)
            if timed_out is None:
                raise
            raise timed_out from e
        finally:
            faulthandler.cancel_dump_traceback_later()

    def _phase(self, phase: str, roles: tuple[str, ...], moves: list[Move], work: Mapping[str, object] | None,
               drop: list[int] | None, discard: dict[str, list[str]] | None) -> PhaseReply:
        if drop:
            self.store.drop(drop)
        xfer = exchange(self.store, self.world.rank, moves, self.world.data_comm, self.world.timeout_s)
        if work is None:
            return {"xfer": xfer}
        spec = PHASES[phase]
        with self.residency.phase(phase, roles, discard) as rec:
            out = self.ops[spec.op](spec, **work)
        return {"out": out, "rec": rec.as_dict(), "xfer": xfer}

    def _generate(self, spec: PhaseSpec, ids: list[int], prompts: list[str], sampling: Sampling,
                  tasks: list[Task] | None = None, seeds: list[int] | None = None,
                  take: int | None = None, group: int = 1,
                  images: list[list[bytes]] | None = None) -> dict[int, Generated]:
        """One response per sample: ``{sid: (prompt length, response length)}``. With ``tasks`` and
        ``seeds`` (a run with an environment) each sample is a trajectory played to its end
        (``_roll_out``). With ``take`` (``algo.partial_rollouts``) the samples join those the
        engine keeps from earlier phases, and the first ``take`` whole groups of ``group`` to finish
        are the answer (``rlbatch.loop.partial``); the rest stay in the engine."""
        maybe_fault("generate", self.world.rank)
        if images is not None and any(images):  # a vision-language policy's prompts with their images
            return self._generate_images(spec, ids, prompts, images, SamplingParams(**sampling))
        unique = list(dict.fromkeys(prompts))  # a group's samples share their prompt: encode it once
        tokens = dict(zip(unique, self.tokenizer(unique)["input_ids"], strict=True))
        as_tensor = {text: torch.tensor(t, dtype=torch.long) for text, t in tokens.items()}
        if tasks is not None and seeds is not None:
            return self._roll_out(spec, ids, [tokens[text] for text in prompts], sampling, tasks, seeds)
        params = SamplingParams(**sampling)
        if take is not None:
            done = self.partial.generate(self.engines[spec.role], self.in_flight, ids, [tokens[t] for t in prompts],
                                         [as_tensor[t] for t in prompts], params, group, take)
        else:
            with landing(self.engines[spec.role], self.in_flight):
                generations = self.engines[spec.role].generate([tokens[text] for text in prompts], params)
            done = [(sid, as_tensor[text], gen) for sid, text, gen in zip(ids, prompts, generations, strict=True)]
        out: dict[int, Generated] = {}
        for sid, prompt, gen in done:
            versions = token_versions(gen.versions, len(gen.tokens), params.version)
            self.store.put(sid, "prompt", prompt)
            self.store.put(sid, "response", torch.tensor(gen.tokens, dtype=torch.long))
            self.store.put(sid, "behaviour_logprobs", torch.tensor(gen.logprobs, dtype=torch.float32))
            self.store.put(sid, "token_versions", versions)
            out[sid] = (len(prompt), len(gen.tokens), version_span(versions, params.version))
        return out

    def _generate_images(self, spec: PhaseSpec, ids: list[int], prompts: list[str], images: list[list[bytes]],
                         params: SamplingParams) -> dict[int, Generated]:
        """``_generate`` of prompts with images (``rlbatch.data.images``): each distinct prompt, text
        and images, through the model's processor once; every sample holds its prompt's ids and
        image fields (``pixel_values``, ``image_grid_thw``) beside the generated ones. The engine
        gets each prompt's images with those fields (``ProcessedImages``): hf runs the model on the
        fields, vLLM processes the images itself."""
        encoded = self.image_prompts.encode(prompts, images)
        keys = [ids[k] for k in same_prompt(prompts, images)]  # samples of one key share the fields' tensors
        inputs = [ProcessedImages.of(im, fields) if im else im for im, (_, fields) in zip(images, encoded, strict=True)]
        with landing(self.engines[spec.role], self.in_flight):
            generations = self.engines[spec.role].generate([e[0] for e in encoded], params, images=inputs)
        out: dict[int, Generated] = {}
        for sid, key, (prompt, fields), gen in zip(ids, keys, encoded, generations, strict=True):
            versions = token_versions(gen.versions, len(gen.tokens), params.version)
            for name, value in {"prompt": torch.tensor(prompt, dtype=torch.long), **fields}.items():
                self.store.put(sid, name, value)
            self.store.put(sid, "response", torch.tensor(gen.tokens, dtype=torch.long))
            self.store.put(sid, "behaviour_logprobs", torch.tensor(gen.logprobs, dtype=torch.float32))
            self.store.put(sid, "token_versions", versions)
            out[sid] = (len(prompt), len(gen.tokens), version_span(versions, params.version), None,
                        {name: len(value) for name, value in fields.items()}, key)
        return out

    def _roll_out(self, spec: PhaseSpec, ids: list[int], prompts: list[list[int]], sampling: Sampling,
                  tasks: list[Task], seeds: list[int]) -> dict[int, Generated]:
        """Each sample a trajectory (``rlbatch.envs.trajectories``): its fields kept here, and
        ``{sid: (prompt length, response length, summary)}`` for the controller (the summary holds
        the trajectory's reward for the score phase). On a worker of several ranks the first plays
        them and the others take its engine calls (``rlbatch.envs.lockstep``)."""
        from rlbatch.engines.base import Turns, turns_of
        from rlbatch.envs.client import env_client
        from rlbatch.envs.lockstep import Lockstep, follow
        from rlbatch.envs.rollout import Trajectory
        from rlbatch.envs.trajectories import MultiTurn, sample_fields, summary

        params = SamplingParams(**sampling)
        turns: Turns = turns_of(self.engines[spec.role])
        done: list[Trajectory]
        [worker] = [w for w in self.world.placement.roles[spec.role].workers if self.world.rank in w]
        if worker[0] != self.world.rank:  # a tensor-parallel worker's other ranks: the leader's engine calls
            done = follow(turns, self.world.comm, worker[0])
        else:
            if self.multi_turn is None:  # envs and tools (the python tool's sandbox) built once per rank
                # or, with an env role, episodes hosted by its workers
                self.multi_turn = MultiTurn(self.cfg, self.tokenizer, client=env_client(self.world, self.cfg))
            if len(worker) > 1:
                turns = Lockstep(turns, self.world.comm, list(worker[1:]))
            done = self.multi_turn(turns, prompts, params, tasks, seeds, params.seed, ids)
            if isinstance(turns, Lockstep):
                turns.finish(done)
        out: dict[int, Generated] = {}
        for sid, traj in zip(ids, done, strict=True):
            for name, value in sample_fields(traj).items():
                self.store.put(sid, name, value)
            versions = token_versions([], len(traj.response), params.version)  # turns are not interrupted
            self.store.put(sid, "token_versions", versions)
            out[sid] = (len(traj.prompt), len(traj.response), version_span(versions, params.version), summary(traj))
        return out

    def _score(self, spec: PhaseSpec, ids: list[int], answers: list[str], sources: list[str] | None = None,
               env_rewards: list[float] | None = None, show: dict[int, list[tuple[int, int]] | None] | None = None,
               ) -> ScoreOutput:
        """This rank's scorer for the phase's role: ``{"rewards": {sid: float}, "counts": {name: int}}``.
        A rule or sandbox scorer reads the decoded responses; a reward model the prompts too. In a run
        with an environment, ``env_rewards`` are the trajectories' (the reward role's scorer reads them).
        ``show``: samples to send back as text too (``shown``), each with its trajectory's spans or None."""
        responses = [self.store.samples[sid]["response"] for sid in ids]
        completions = [str(self.tokenizer.decode(r.tolist(), skip_special_tokens=False)) for r in responses]
        scorer = self.scorers[spec.role]
        try:
            if isinstance(scorer, ModelScorer):
                rewards, counts = scorer([self.store.samples[sid]["prompt"] for sid in ids], responses, completions,
                                         answers, sources)
            elif env_rewards is not None:
                rewards, counts = scorer(completions, answers, sources, env_rewards=env_rewards)
            else:
                rewards, counts = scorer(completions, answers, sources)
        except RewardError as e:  # name the sample the run knows, not its place in this rank's share
            raise e.for_sample(ids[e.index]) from e
        out: ScoreOutput = {"rewards": dict(zip(ids, rewards, strict=True)), "counts": counts}
        if show:
            from rlbatch.loop.samples import decode_shown

            def decode(tokens: list[int]) -> str:
                return str(self.tokenizer.decode(tokens, skip_special_tokens=False))

            text = dict(zip(ids, completions, strict=True))
            out["shown"] = {sid: decode_shown(decode, held["prompt"].tolist() if "prompt" in held else None,
                                              held["response"].tolist(), spans, text[sid])
                            for sid, spans in show.items() for held in [self.store.samples[sid]]}
        return out

    def _per_token(self, spec: PhaseSpec, ids: list[int]) -> list[torch.Tensor]:
        """Run the engine's method named by the phase's op (logprobs, base_logprobs, values) on
        ``ids`` and keep the result as the phase's output field."""
        samples = self.store.get(ids, list(spec.reads))
        values = getattr(self.engines[spec.role], spec.op)(samples) if ids else []
        for sid, v in zip(ids, values, strict=True):
            self.store.put(sid, spec.writes[0], v)
        return values

    def _logprobs(self, spec: PhaseSpec, ids: list[int], kl_estimator: str | None = None,
                  ) -> dict[int, float | list[float]]:
        """Log-probs into the phase's field; with ``kl_estimator``, each sample's per-token KL to
        the reference's log-probs (for a KL penalty in the reward), else lengths."""
        values = self._per_token(spec, ids)
        if kl_estimator is None:
            return {sid: float(len(v)) for sid, v in zip(ids, values, strict=True)}
        kl = KL_ESTIMATORS.get(kl_estimator)
        out: dict[int, float | list[float]] = {}
        for sid, logp in zip(ids, values, strict=True):
            per_token = kl(logp, self.store.samples[sid]["ref_logprobs"])
            if "loss_mask" in self.store.samples[sid]:  # the env's tokens are no action of the policy's
                per_token = per_token * self.store.samples[sid]["loss_mask"]
            out[sid] = per_token.tolist()
        return out

    def _values(self, spec: PhaseSpec, ids: list[int]) -> dict[int, list[float]]:
        """The critic's per-token values, kept as the phase's field and returned (the controller
        turns them into advantages)."""
        values = self._per_token(spec, ids)
        return {sid: v.tolist() for sid, v in zip(ids, values, strict=True)}

    def _train(self, spec: PhaseSpec, ids: list[int], targets: dict[str, list[float] | list[list[float]]],
               ) -> dict[str, float]:
        """``targets``: per-sample fields the controller computed, by name, each a float per sample
        (``advantage``) or a list of per-token values per sample (``advantages``, ``returns``)."""
        for name, per_sample in targets.items():
            for sid, value in zip(ids, per_sample, strict=True):
                self.store.put(sid, name, torch.tensor(value, dtype=torch.float32))
        maybe_fault("train", self.world.rank)  # tests: a rank of the trainer that hangs
        objective = self.objectives[spec.role]
        fields = [*spec.reads, *objective.reads, *targets]
        if self.cfg.algo.overlong_filter and objective.head == "lm":  # DAPO: truncated responses out of the loss
            eos, longest = self.tokenizer.eos_token_id, int(self.cfg.algo.max_new_tokens)
            for sid in ids:
                self.store.put(sid, "loss_mask", response_loss_mask(self.store.samples[sid]["response"], eos, longest))
            fields.append("loss_mask")
        return self.engines[spec.role].train(self.store.get(ids, fields), objective)

    def _buffer(self, spec: PhaseSpec, op: str, ids: list[int] | None = None,
                samples: dict[int, dict[str, torch.Tensor]] | None = None,
                fields: list[str] | None = None, kept: KeptState | None = None,
                ) -> dict[int, dict[str, torch.Tensor]] | KeptState:
        """Generated samples not yet trained on: ``op=read`` returns their ``fields`` (the phase's
        by default; for a checkpoint), ``op=restore`` keeps ``samples`` on this rank again.
        ``op=read_kept`` / ``restore_kept``: the samples the engine keeps in flight across generate
        phases (``algo.partial_rollouts``, ``rlbatch.loop.partial``)."""
        if op == "read_kept":
            return self.partial.save(self.engines[spec.role])
        if op == "restore_kept":
            assert kept is not None
            self.partial.restore(self.engines[spec.role], kept)
            return {}
        if op == "restore":
            for sid, held in (samples or {}).items():
                for name, value in held.items():
                    self.store.put(sid, name, value)
            return {}
        return {sid: {f: self.store.samples[sid][f].clone() for f in fields or spec.writes if f in self.store.samples[sid]}
                for sid in ids or []}

    def _checkpoint(self, spec: PhaseSpec, op: str, path: str) -> dict[str, float]:
        """Write (op=save, into the staging dir) or read (op=load) this rank's part of a checkpoint."""
        from rlbatch.checkpoint.engine_state import load_rank, save_rank

        if op == "load":
            return load_rank(Path(path), self.engines, self.world.rank)
        out = save_rank(Path(path), self.engines, self.world.rank)
        maybe_fault("checkpoint", self.world.rank)
        return out

    def _sync(self, spec: PhaseSpec, src: int, local: bool, bucket_bytes: int, form: str = "merged",
              version: int = 0) -> dict[str, float]:
        """Trainer -> inference engine, streamed one gathered unit at a time in the inference engine's
        dtype (``rlbatch.loop.weightsync``). Colocated: each unit loaded in process; otherwise a
        bucketed broadcast over the sync group. Every trainer rank iterates its export to the end, in
        the same dtype: the gathers are collective over the trainer's ranks. ``form`` 'adapter': the
        trainer's adapters alone (``export_adapters``) into the engine's ``load_adapters``
        (``rlbatch.models.lora.sync_form``); else its full weights.

        Fault points (tests, ``rlbatch.runtime.faults``): ``sync_send`` on the sending rank and
        ``sync_recv`` on a receiving one, as the sync starts; ``sync_bucket`` before each bucket of
        a broadcast; ``drop`` at ``sync_recv`` leaves the sync's first tensor unloaded there.

        ``version``: the policy version sent. With ``algo.in_flight_updates`` the sender first
        notifies the inference ranks, and one that was generating took the sync between two engine
        steps already (``rlbatch.loop.weightsync.InFlightSync``)."""
        assert spec.peer is not None
        train, infer = self.engines.get(spec.role), self.engines.get(spec.peer)
        wire = self.broadcast.wire_dtype
        adapters = form == "adapter"
        if adapters and infer is not None:
            infer = AdapterSink(infer)
        export = (train.export_adapters if adapters else train.export_weights) if train is not None else None
        with export() if export is not None else nullcontext(None) as weights:
            if self.world.rank == src:
                maybe_fault("sync_send", self.world.rank)
            elif infer is not None and fault_at("sync_recv", self.world.rank) == "drop":  # the first tensor not loaded
                infer = DropFirst(infer)
            if local:
                return {"bytes": float(load_in_process(weights, infer, wire))}
            if self.in_flight is not None and self.world.rank == src:
                self.in_flight.notify(version, bucket_bytes)
            elif self.in_flight is not None and infer is not None:
                return {"bytes": float(self.in_flight.receive(infer)[1])}
            if self.world.rank not in self.world.members[SYNC]:
                if weights is not None:
                    weights.drain(wire)
                return {"bytes": 0.0}
            return {"bytes": float(self.broadcast(self.world, weights, infer, src, bucket_bytes))}
