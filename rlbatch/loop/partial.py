"""Partial rollouts on an inference rank (``algo.partial_rollouts``).

The inference engine keeps its requests across generate phases: a phase adds its samples to
those still running from earlier phases, steps the engine until ``take`` whole groups have
finished and answers with them; the samples still running stay in the engine and go on in the
next phase, under whatever weights have landed meanwhile (``algo.in_flight_updates``). A step's
batch is therefore formed while long samples are still generating, and a long sample ends up in
a later step's batch with tokens of several policy versions (docs/async.md, "Partial rollouts").
"""

from __future__ import annotations

from typing import Protocol, TypedDict, cast

import torch

from rlbatch.engines.base import Generation, SamplingParams
from rlbatch.loop.weightsync import InFlightSync, landing


class KeptSample(TypedDict):
    """A sample the engine holds, as a checkpoint keeps it: its prompt's token ids, the tokens
    sampled so far with each one's behaviour log-prob and policy version, and whether it has
    finished (a finished sample waits for its group, or for a later call's ``take``)."""

    key: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool


class KeptState(TypedDict):
    """What an engine that keeps samples holds between two ``generate_some`` calls (``kept_state``):
    the samples in the order its scheduler would run them next, the group size, the whole groups
    finished and not returned (in finishing order), and the version its kept requests last ran."""

    samples: list[KeptSample]
    group: int
    ready: list[int]
    version: int


class KeepsSamples(Protocol):
    """An inference engine that keeps requests across calls (vllm): ``generate_some`` adds one
    request per sample and returns the first ``take`` whole groups of ``group`` consecutive sample
    ids to finish, as (sample id, generation) sorted by id, and may return with them groups it
    stopped that can no longer be trained (a token past ``algo.max_staleness`` at the weights it
    holds: the controller drops them); ``kept`` counts the samples it holds.
    ``kept_state`` reads what it holds for a checkpoint (and the next call goes on from that state
    exactly as a restored engine would: ``restore_kept`` into an engine that holds nothing)."""

    def generate_some(self, keys: list[int], prompts: list[list[int]], params: SamplingParams, group: int,
                      take: int) -> list[tuple[int, Generation]]: ...

    def kept(self) -> int: ...

    def kept_state(self) -> KeptState: ...

    def restore_kept(self, state: KeptState) -> None: ...


def keeps_samples(engine: object) -> bool:
    return all(callable(getattr(engine, m, None)) for m in ("generate_some", "kept", "kept_state", "restore_kept"))


class PartialRollouts:
    """The prompt of each sample that the engine holds across generate phases."""

    def __init__(self) -> None:
        self.prompts: dict[int, torch.Tensor] = {}

    def generate(self, engine: object, sync: InFlightSync | None, ids: list[int], prompts: list[list[int]],
                 tensors: list[torch.Tensor], params: SamplingParams, group: int, take: int,
                 ) -> list[tuple[int, torch.Tensor, Generation]]:
        """The phase's samples into ``engine`` beside the ones it holds; the first ``take`` whole
        groups to finish as (sample id, prompt, generation), syncs landing between engine steps."""
        keeper = _keeper(engine)
        self.prompts.update(zip(ids, tensors, strict=True))
        with landing(engine, sync):
            got = keeper.generate_some(ids, prompts, params, group, take)
        return [(sid, self.prompts.pop(sid), gen) for sid, gen in got]

    def save(self, engine: object) -> KeptState:
        """The samples ``engine`` holds, for a checkpoint (each with its prompt)."""
        state = _keeper(engine).kept_state()
        missing = [s["key"] for s in state["samples"] if s["key"] not in self.prompts]
        if missing:
            raise RuntimeError(f"partial rollouts: the engine holds samples {missing[:5]} whose prompts this rank "
                               f"does not keep ({len(missing)} of {len(state['samples'])})")
        return state

    def restore(self, engine: object, state: KeptState) -> None:
        """Put the samples ``save`` read back into ``engine`` (which holds none): the next
        generate phase goes on with them before its own samples."""
        if self.prompts:
            raise RuntimeError(f"partial rollouts: restoring kept samples onto a rank that already keeps "
                               f"{len(self.prompts)}")
        _keeper(engine).restore_kept(state)
        self.prompts = {s["key"]: torch.tensor(s["prompt"], dtype=torch.long) for s in state["samples"]}


def _keeper(engine: object) -> KeepsSamples:
    if not keeps_samples(engine):
        raise RuntimeError(f"algo.partial_rollouts: the inference engine {type(engine).__name__} does not keep "
                           f"requests across generations (no generate_some): use vllm")
    return cast("KeepsSamples", engine)
