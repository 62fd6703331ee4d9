"""The phase table: every unit of work a step is made of, in one place.

For each phase: the role that works in it, the state kinds of that role that must be on the
device, the sample fields it reads and writes, how its samples are dispatched to the role's
ranks, the operation a rank runs for it, and the phase kind the planner calibrates it as. The
controller, the rank runtime, the offload residency and the planner's schedule all read this
table; none of them switches on a role or phase name.

Torch-free: the planner imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from rlbatch.config.schema import LoraConfig


class Dispatch(str, Enum):
    """How a phase's samples reach the role's ranks."""

    WORKERS = "workers"
    """Prompts split evenly over the role's workers (engine instances); every rank of a worker
    gets the worker's share, its first rank answers."""
    SHARDS = "shards"
    """Samples split over the role's data-parallel shards (the engine's ``data_axes``), keeping each
    on the rank that already holds it where possible; tp/pp peers of a shard get the same samples."""
    RANKS = "ranks"
    """Samples split evenly over the role's processes (CPU workers)."""
    COLLECTIVE = "collective"
    """Every rank of the roles takes part (weight sync, checkpoints); no samples."""


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    role: str
    """The role that works in this phase (sync: the sending role; see ``peer``)."""
    op: str
    """The rank operation that runs it: generate, score, logprobs, values, train, sync, checkpoint."""
    needs: tuple[str, ...]
    """State kinds of the working role(s) that must be resident on the device."""
    reads: tuple[str, ...]
    """Sample fields the working ranks must hold before it runs."""
    writes: tuple[str, ...]
    """Sample fields it produces (kept on the rank that produced them)."""
    dispatch: Dispatch
    kind: str
    """The planner's calibration group: generate, reward, logprobs, train, sync."""
    peer: str | None = None
    """A second role working in the phase (sync: the receiving inference role)."""
    overwrites: tuple[tuple[str, str], ...] = ()
    """(role, state kind) pairs whose contents the phase replaces whole without reading them (sync:
    the inference role's params). Until it runs, an offload of such state need not keep it
    (``Pipeline.announce``)."""

    @property
    def roles(self) -> tuple[str, ...]:
        return (self.role,) if self.peer is None else (self.role, self.peer)


TRAIN_STATE = ("params", "grads", "optimizer")

IMAGE_FIELDS = ("pixel_values", "image_grid_thw")
"""Fields ``generate`` writes only for a prompt with images (a vision-language policy,
``rlbatch.data.images``): the processor's ``pixel_values`` (flattened) and ``image_grid_thw``
(three per image); the phases that run the policy on the samples read them."""

PHASES: dict[str, PhaseSpec] = {p.name: p for p in (
    PhaseSpec("generate", "actor_infer", "generate", ("params", "kv_cache"), (),
              ("prompt", "response", "behaviour_logprobs", "token_versions", "loss_mask", *IMAGE_FIELDS),
              Dispatch.WORKERS, "generate"),
    PhaseSpec("score", "reward", "score", ("params",), ("prompt", "response"), ("reward",), Dispatch.RANKS, "reward"),
    PhaseSpec("execute", "code_sandbox", "score", (), ("response",), ("code_reward",), Dispatch.RANKS, "reward"),
    PhaseSpec("ref_logprobs", "reference", "logprobs", ("params",), ("prompt", "response", *IMAGE_FIELDS), ("ref_logprobs",),
              Dispatch.SHARDS, "logprobs"),
    PhaseSpec("base_logprobs", "actor_train", "base_logprobs", ("params",), ("prompt", "response", *IMAGE_FIELDS),
              ("ref_logprobs",),
              Dispatch.SHARDS, "logprobs"),
    PhaseSpec("values", "critic", "values", ("params",), ("prompt", "response"), ("values",),
              Dispatch.SHARDS, "logprobs"),
    PhaseSpec("old_logprobs", "actor_train", "logprobs", ("params",), ("prompt", "response", *IMAGE_FIELDS),
              ("old_logprobs",),
              Dispatch.SHARDS, "logprobs"),
    PhaseSpec("critic_train", "critic", "train", TRAIN_STATE, ("prompt", "response", "values", "reward", "loss_mask"),
              (), Dispatch.SHARDS, "train"),
    PhaseSpec("train", "actor_train", "train", TRAIN_STATE,
              ("prompt", "response", "old_logprobs", "ref_logprobs", "reward", "loss_mask", *IMAGE_FIELDS), (),
              Dispatch.SHARDS,
              "train"),
    PhaseSpec("sync", "actor_train", "sync", ("params",), (), (), Dispatch.COLLECTIVE, "sync", peer="actor_infer",
              overwrites=(("actor_infer", "params"),)),
    PhaseSpec("checkpoint", "actor_train", "checkpoint", ("params", "optimizer"), (), (), Dispatch.COLLECTIVE, "sync"),
    PhaseSpec("rollout_buffer", "actor_infer", "buffer", (), (),
              ("prompt", "response", "behaviour_logprobs", "token_versions", "loss_mask"), Dispatch.WORKERS, "sync"),
)}
"""Phase name -> its row. ``checkpoint`` acts for every trainable role on a rank (its role is the
first of them; ``needs`` applies to each). A field a phase reads but no earlier phase of the step
wrote is simply absent (``values`` without a critic; ``reward`` stays with the controller, which
turns it into advantages): reads also say which phases must finish first. A training phase also
reads the fields its objective names (``objective.reads``: the behaviour log-probs for an
off-policy correction). A field a phase writes may be absent too: ``TRAJECTORY_FIELDS`` are written
only by a multi-turn rollout (``env.name``). ``base_logprobs`` writes the reference's log-probs
from the trained policy's base model, its adapters switched off (``model.lora``: no reference role
is placed, ``reference_is_actor_base``). ``rollout_buffer``
reads (into a checkpoint) or restores generated samples not yet trained on (asynchronous
training, ``algo.max_staleness``). ``token_versions`` holds the policy version of the weights that
sampled each response token (int64; they differ within a sample where weights land mid-generation,
``algo.in_flight_updates``)."""

PER_TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "behaviour_logprobs", "values", "advantages", "returns",
                    "loss_mask")
"""Sample fields with one value per response token."""

TRAJECTORY_FIELDS = ("loss_mask",)
"""Fields ``generate`` writes only for a multi-turn rollout (``env.name``): ``loss_mask`` is 1 on the
tokens the policy generated and 0 on the environment's observation tokens between its turns. A
sample without one is trained on every response token."""


def phase(name: str) -> PhaseSpec:
    if name not in PHASES:
        raise KeyError(f"unknown phase {name!r}; phases: {sorted(PHASES)}")
    return PHASES[name]


def step_phases(*, kl_to_reference: bool, has_reference: bool, critic: bool, reuse_batch: bool,
                kl_in_reward: bool, code_sandbox: bool = False, rule_reward: bool = True,
                base_reference: bool = False) -> list[str]:
    """The phases one step runs, in the controller's order: the policy-gradient loop, or PPO's
    with ``critic`` (values before the advantages, the critic's training before the actor's).

    ``reuse_batch``: more than one optimizer step per batch, so the policy before the updates must
    be recorded (old_logprobs); ``kl_in_reward`` needs it too (the KL is taken before updating).
    ``code_sandbox``: responses also run against their tests (``execute``); ``rule_reward``: the
    reward role scores them with data.reward_fn; ``base_reference``: the reference's log-probs are
    the trained policy's base model's (``model.lora``), taken on its ranks instead of a reference role's."""
    out = ["generate", *(["score"] if rule_reward else []), *(["execute"] if code_sandbox else [])]
    if kl_to_reference and base_reference:
        out.append("base_logprobs")
    elif kl_to_reference and has_reference:
        out.append("ref_logprobs")
    if critic:
        out.append("values")
    if reuse_batch or kl_in_reward:
        out.append("old_logprobs")
    if critic:
        out.append("critic_train")
    return [*out, "train", "sync"]


def reference_is_actor_base(lora: LoraConfig) -> bool:
    """Whether the reference's log-probs come from the trained policy's base model, its adapters
    off (``model.lora`` with a rank: the reference is that base model, so no reference role is
    placed)."""
    return lora.rank > 0


def phase_for(role: str, op: str) -> PhaseSpec:
    """The phase in which ``role`` runs ``op`` (e.g. reference + logprobs -> ref_logprobs)."""
    found = [p for p in PHASES.values() if p.role == role and p.op == op]
    if len(found) != 1:
        raise KeyError(f"no single phase runs {op!r} for role {role!r} (found {[p.name for p in found]})")
    return found[0]
