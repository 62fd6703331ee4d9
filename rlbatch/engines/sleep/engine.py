"""The ``sleep`` engines (``rlbatch.engines.sleep``): the engine contract with no model behind it."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from rlbatch.engines.base import CheckpointState, EngineContext, Generation, Sample, SamplingParams, WeightStream
from rlbatch.engines.inference import NoModelInference
from rlbatch.engines.offload import Transfer
from rlbatch.engines.sleep import SleepArgs, SleepTrainArgs

if TYPE_CHECKING:
    from rlbatch.engines.base import Objective


def _nap(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class SleepInferenceEngine(NoModelInference):
    def __init__(self, ctx: EngineContext) -> None:
        args: SleepArgs = ctx.args if isinstance(ctx.args, SleepArgs) else SleepArgs()
        self.seconds, self.tokens = args.seconds, args.response_tokens
        self.eos = int(ctx.tokenizer.eos_token_id)
        filler = ctx.tokenizer.convert_tokens_to_ids("0")  # a digit: the reward parses the response
        self.filler = filler if isinstance(filler, int) else self.eos

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        _nap(self.seconds)
        n = min(self.tokens, params.max_new_tokens)
        tokens = [self.filler] * (n - 1) + [self.eos]
        return [Generation(list(tokens), [0.0] * n) for _ in prompts]


class SleepTrainEngine:
    state_kinds: tuple[str, ...] = ()

    def __init__(self, ctx: EngineContext) -> None:
        args: SleepTrainArgs = ctx.args if isinstance(ctx.args, SleepTrainArgs) else SleepTrainArgs()
        self.seconds = args.seconds
        self.weights = torch.zeros(args.weight_elems, dtype=torch.float32)

    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        _nap(self.seconds)
        return [torch.zeros(len(s["response"]), dtype=torch.float32) for s in samples]

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        raise NotImplementedError("the sleep_train engine builds only an lm head")

    def scores(self, samples: list[Sample]) -> list[float]:
        raise NotImplementedError("the sleep_train engine builds only an lm head")

    def train(self, samples: list[Sample], objective: Objective) -> dict[str, float]:
        _nap(self.seconds)
        return {"loss": 0.0, "samples": float(len(samples))}

    @contextmanager
    def export_weights(self) -> Iterator[WeightStream]:
        yield WeightStream.of([("model.weight", self.weights)])

    def checkpoint_state(self) -> CheckpointState | None:
        return None

    def load_checkpoint_state(self, state: CheckpointState) -> None:
        pass

    def offload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()

    def reload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()
