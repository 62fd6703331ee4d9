"""The engine contract: small Protocols the scheduler drives without knowing the implementation.

An engine is one role's model on one rank. It is built from an ``EngineContext`` (its role, its
typed engine_args, the model and algorithm configs, the device and the DeviceMesh ``world``
carved for the role) by ``build_engine``, which finds the implementation through the registry
(``rlbatch/engines/registry.py``). Every engine:

- owns its device state by kind (``params``, ``grads``, ``optimizer``, ``kv_cache``) and moves it
  to host memory and back itself (``offload`` / ``reload``, bytes and seconds reported);
- speaks Hugging Face parameter names at its edges: a training engine exports its full weights
  as ``(hf_name, tensor)`` pairs, an inference engine loads them, whatever each does inside;
- gives its checkpoint state as named tensors plus small metadata (``CheckpointState``), which
  one engine-neutral store writes and reads.

Inference engines generate tokens and the behaviour log-prob of each sampled token; training
engines compute log-probs (and values, for a critic) and train on a loss from ``rlbatch.algos``
that they never look inside. Which ranks receive which samples is declared in the registry
(``EngineSpec.data_axes``), not decided here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlbatch.config.schema import AlgoConfig, ModelConfig
from rlbatch.engines.offload import Transfer
from rlbatch.engines.registry import spec_of

Sample = dict[str, torch.Tensor]
"""One sample as engines see it: 1-D tensors by field (prompt, response, per-token fields)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()
    seed: int = 0


@dataclass
class Generation:
    """One response: its token ids (ending with EOS when it stopped there) and the log-prob of each
    under the distribution it was sampled from (after temperature and top-p)."""

    tokens: list[int]
    logprobs: list[float]


@dataclass
class EngineContext:
    """Everything an engine is built from."""

    role: str
    args: Any
    """The engine's typed engine_args (a dataclass from the registry)."""
    model: ModelConfig
    """The run's model."""
    algo: AlgoConfig
    """The run's algorithm settings (optimizer, mini-batches, epochs, ...)."""
    tokenizer: Any
    device: torch.device
    seed: int
    mesh: Any = None
    """The role's DeviceMesh with named axes (dp, tp, pp, cp) over the role's ranks."""
    trainable: bool = False
    """Whether the role has an optimizer (actor_train, critic)."""
    head: str = "lm"
    """'lm': the policy (a causal LM); 'value': a value model (the critic: a scalar per token);
    'reward': a sequence-classification model (a reward model: a score per sequence)."""
    groups: dict[str, Any] = field(default_factory=dict)
    """Process groups beyond the mesh axes, created by ``rlbatch.runtime.world`` on every rank:
    'role' (all the role's ranks) and, with pipeline stages, 'model_parallel' and 'pipeline_ends'
    (``rlbatch.placement.subgroups``). Empty for an engine built by hand over a mesh."""

    def group(self, axis: str) -> Any:
        """The process group of one mesh axis (e.g. 'dp') containing this rank."""
        return self.mesh.get_group(axis)


@dataclass
class CheckpointState:
    """An engine's checkpointed state: named tensors (sharded or not; saved and resharded by DCP),
    small metadata (plain Python values), and the process group whose ranks write it together."""

    tensors: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    group: Any = None


class Engine(Protocol):
    state_kinds: tuple[str, ...]
    """The kinds of device state this engine holds (a subset of params, grads, optimizer, kv_cache)."""

    def offload(self, kinds: Iterable[str]) -> Transfer:
        """Move these kinds of state off the device (no-op for kinds already off)."""
        ...

    def reload(self, kinds: Iterable[str]) -> Transfer:
        """Bring these kinds of state back, exactly as they were."""
        ...


class InferenceEngine(Engine, Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One response per prompt (prompts repeat for several samples of one prompt)."""
        ...

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load (hf_name, full tensor) pairs into the model; returns bytes loaded. The tensors may be
        read after the call returns (until the next call): the caller must not reuse their memory."""
        ...

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        """The model's own memory of these parameters as one 1-D ``dtype`` tensor when they lie back
        to back in it (receiving into it loads them), else None."""
        ...


class TrainEngine(Engine, Protocol):
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample log-probs of the response tokens."""
        ...

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample value estimates of the response tokens (a critic)."""
        ...

    def scores(self, samples: list[Sample]) -> list[float]:
        """One score per sample from a sequence-classification model (a reward model)."""
        ...

    def train(self, samples: list[Sample], objective: Any) -> dict[str, float]:
        """One batch of updates (mini-batches x epochs) minimising ``objective``
        (``rlbatch.algos.objective``); returns averaged stats."""
        ...

    def export_weights(self) -> AbstractContextManager[list[tuple[str, torch.Tensor]]]:
        """Full weights as (hf_name, tensor), valid inside the ``with`` block. Collective over the
        role's ranks."""
        ...

    def checkpoint_state(self) -> CheckpointState | None:
        """The state to checkpoint (None for a forward-only engine). On load, the same call gives
        the tensors to read into, then ``load_checkpoint_state`` applies them."""
        ...

    def load_checkpoint_state(self, state: CheckpointState) -> None:
        ...


def build_engine(engine: str, ctx: EngineContext) -> Any:
    """Build the registered implementation of ``engine`` (validation refused unbuilt ones)."""
    spec = spec_of(engine)
    if spec.implementation is None:
        raise NotImplementedError(f"engine '{engine}' is not built: {spec.note}")
    if ctx.head not in spec.heads:  # validation refused it too
        raise NotImplementedError(f"engine '{engine}', role {ctx.role}: a {ctx.head} head is not built")
    module, _, name = spec.implementation.partition(":")
    return getattr(importlib.import_module(module), name)(ctx)
