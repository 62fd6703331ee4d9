"""Partial rollouts on an inference rank (``algo.partial_rollouts``).

The inference engine keeps its requests across generate phases: a phase adds its samples to
those still running from earlier phases, steps the engine until ``take`` whole groups have
finished and answers with them; the samples still running stay in the engine and go on in the
next phase, under whatever weights have landed meanwhile (``algo.in_flight_updates``). A step's
batch is therefore formed while long samples are still generating, and a long sample ends up in
a later step's batch with tokens of several policy versions (docs/async.md, "Partial rollouts").
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from rlbatch.engines.base import Generation, SamplingParams
from rlbatch.loop.weightsync import InFlightSync, landing


class KeepsSamples(Protocol):
    """An inference engine that keeps requests across calls (vllm): ``generate_some`` adds one
    request per sample and returns the first ``take`` whole groups of ``group`` consecutive sample
    ids to finish, as (sample id, generation) sorted by id; ``kept`` counts the samples it holds."""

    def generate_some(self, keys: list[int], prompts: list[list[int]], params: SamplingParams, group: int,
                      take: int) -> list[tuple[int, Generation]]: ...

    def kept(self) -> int: ...


def keeps_samples(engine: object) -> bool:
    return all(callable(getattr(engine, m, None)) for m in ("generate_some", "kept"))


class PartialRollouts:
    """The prompt of each sample that the engine holds across generate phases."""

    def __init__(self) -> None:
        self.prompts: dict[int, torch.Tensor] = {}

    def generate(self, engine: object, sync: InFlightSync | None, ids: list[int], prompts: list[list[int]],
                 tensors: list[torch.Tensor], params: SamplingParams, group: int, take: int,
                 ) -> list[tuple[int, torch.Tensor, Generation]]:
        """The phase's samples into ``engine`` beside the ones it holds; the first ``take`` whole
        groups to finish as (sample id, prompt, generation), syncs landing between engine steps."""
        if not keeps_samples(engine):
            raise RuntimeError(f"algo.partial_rollouts: the inference engine {type(engine).__name__} does not keep "
                               f"requests across generations (no generate_some): use vllm")
        keeper = cast("KeepsSamples", engine)
        self.prompts.update(zip(ids, tensors, strict=True))
        with landing(engine, sync):
            got = keeper.generate_some(ids, prompts, params, group, take)
        return [(sid, self.prompts.pop(sid), gen) for sid, gen in got]
