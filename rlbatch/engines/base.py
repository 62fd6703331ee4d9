"""Engine Protocols and the factory that picks an implementation from the backend string.

An inference engine generates and takes weights; a training engine computes log-probs and
updates; both expose their device state by kind (``stashes``) so the scheduler can offload
and reload it at phase boundaries. Engines import their heavy libraries only when built.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlbatch.scheduler.offload import TensorStash

IMPLEMENTATIONS: dict[str, str] = {
    "hf": "rlbatch.engines.infer.hf:HFInferenceEngine",
    "fsdp": "rlbatch.engines.train.fsdp:FSDPEngine",
}
"""Engine name (from the backend string) -> implementation. Engines the placement language
accepts but this build does not implement (vllm, sglang, deepspeed, megatron) fail at start
with a message that says so."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()
    seed: int = 0


class InferenceEngine(Protocol):
    stashes: dict[str, TensorStash]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Response token ids for each prompt (ending with EOS when it stopped there)."""
        ...

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (name, full tensor) pairs into the model; returns bytes copied."""
        ...

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        """The model's own memory of these parameters as one 1-D ``dtype`` tensor, when they lie
        back to back in it as they are (writing it loads them), else None."""
        ...


class TrainEngine(Protocol):
    stashes: dict[str, TensorStash]

    def logprobs(self, samples: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per-sample log-probs of the response tokens."""
        ...

    def train(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """One batch of updates (mini-batches x epochs); returns averaged stats."""
        ...

    def full_weights(self) -> AbstractContextManager[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) weights by name, valid inside the ``with`` block. Collective over the
        role's ranks."""
        ...


def engine_class(engine: str) -> Any:
    if engine not in IMPLEMENTATIONS:
        raise NotImplementedError(
            f"engine '{engine}' is accepted by the placement language but not implemented in this "
            f"build; implemented engines: {sorted(IMPLEMENTATIONS)}"
        )
    module, _, name = IMPLEMENTATIONS[engine].partition(":")
    return getattr(importlib.import_module(module), name)
