"""The engine contract: small Protocols the RL loop drives without knowing the implementation.

An engine is one role's model on one rank. It is built from an ``EngineContext`` (its role, its
typed engine_args, the model and algorithm configs, the device and the DeviceMesh ``world``
carved for the role) by ``build_engine``, which finds the implementation through the registry
(``rlbatch/engines/registry.py``). Every engine:

- owns its device state by kind (``params``, ``grads``, ``optimizer``, ``kv_cache``) and moves it
  to host memory and back itself (``offload`` / ``reload``, bytes and seconds reported);
- speaks Hugging Face parameter names at its edges: a training engine exports its full weights
  as ``(hf_name, tensor)`` pairs, streamed one gathered unit at a time (``WeightStream``), an
  inference engine loads them, whatever each does inside;
- gives its checkpoint state as named tensors plus small metadata (``CheckpointState``), which
  one engine-neutral store writes and reads.

Inference engines generate tokens and the behaviour log-prob of each sampled token; training
engines compute log-probs (and values, for a critic) and train on a loss from ``rlbatch.algos``
that they never look inside. Which ranks receive which samples is declared in the registry
(``EngineSpec.data_axes``), not decided here.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import itertools
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeGuard

import torch

from rlbatch.config.schema import AlgoConfig, ModelConfig
from rlbatch.engines.offload import Transfer
from rlbatch.engines.registry import spec_of
from rlbatch.models import lora

if TYPE_CHECKING:
    from mpi4py import MPI
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedTokenizerBase

    from rlbatch.algos.objective import PolicyObjective
    from rlbatch.algos.value import ValueObjective
    from rlbatch.config.schema import LoraConfig

    Objective: TypeAlias = PolicyObjective | ValueObjective
    """What a training engine minimises (``rlbatch.algos.objective.objective_for``)."""

Sample = dict[str, torch.Tensor]
"""One sample as engines see it: 1-D tensors by field (prompt, response, per-token fields)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    version: int = 0
    """The policy version of the weights the engine holds as the generation starts: its tokens carry
    it (and, where weights land mid-generation, the version of each load after it)."""


@dataclass
class Generation:
    """One response: its token ids (ending with EOS when it stopped there) and the log-prob of each
    under the distribution it was sampled from (after temperature and top-p)."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int] = field(default_factory=list)
    """The policy version of the weights that sampled each token (``SamplingParams.version``, or a
    later one loaded mid-generation); empty from an engine that records none: every token is of
    ``SamplingParams.version``."""


@dataclass
class EngineContext:
    """Everything an engine is built from."""

    role: str
    args: Any
    """The engine's typed engine_args: an instance of its own dataclass (``EngineSpec.args`` in the
    registry), which each engine annotates where it reads it."""
    model: ModelConfig
    """The run's model."""
    algo: AlgoConfig
    """The run's algorithm settings (optimizer, mini-batches, epochs, ...)."""
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    seed: int
    mesh: DeviceMesh | None = None
    """The role's DeviceMesh with named axes (dp, tp, pp, cp) over the role's ranks."""
    trainable: bool = False
    """Whether the role has an optimizer (actor_train, critic)."""
    head: str = "lm"
    """'lm': the policy (a causal LM); 'value': a value model (the critic: a scalar per token);
    'reward': a sequence-classification model (a reward model: a score per sequence)."""
    groups: dict[str, ProcessGroup] = field(default_factory=dict)
    """Process groups beyond the mesh axes, created by ``rlbatch.runtime.world`` on every rank:
    'role' (all the role's ranks) and, with pipeline stages, 'model_parallel' and 'pipeline_ends'
    (``rlbatch.placement.subgroups``). Empty for an engine built by hand over a mesh."""
    comm: MPI.Comm | None = None
    """The world's MPI communicator, for host messages between the ranks of one worker (None for an
    engine built by hand over a mesh)."""

    def group(self, axis: str) -> ProcessGroup:
        """The process group of one mesh axis (e.g. 'dp') containing this rank."""
        return require_mesh(self.mesh, f"role {self.role}").get_group(axis)


def require_mesh(mesh: DeviceMesh | None, who: str) -> DeviceMesh:
    """``mesh``, which an engine that shards or splits its model over ranks cannot do without."""
    if mesh is None:
        raise ValueError(f"{who}: the engine needs the role's DeviceMesh (EngineContext.mesh)")
    return mesh


@dataclass
class CheckpointState:
    """An engine's checkpointed state: named tensors (sharded or not; saved and resharded by DCP),
    small metadata (plain Python values), and the process group whose ranks write it together."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    """Plain Python values (param groups, the LR scheduler's state, ...), each engine's own."""
    group: ProcessGroup | None = None


Unit = list[tuple[str, torch.Tensor]]
"""Weights a training engine gathers together (an FSDP unit, a decoder layer): (hf_name, tensor) pairs."""


class WeightStream:
    """A training engine's full weights on their way out (``TrainEngine.export_weights``), gathered
    one unit at a time so that no rank ever holds the whole model twice.

    - ``manifest``: (hf_name, full shape) of every tensor, in the order they come. Known without
      gathering anything.
    - ``units(dtype)``: the tensors, unit by unit, each unit a list of (hf_name, tensor) in manifest
      order. A unit is what the engine gathers together: an FSDP unit (the whole model when it is
      one), a decoder layer, the embedding, the final norm and head. Nothing is gathered before its
      unit is asked for. Each tensor comes in ``dtype`` (None: the engine's own parameter dtype); an
      engine that shards a tensor casts its own shard before gathering, so the gather moves
      ``dtype``'s bytes (half of fp32's for bf16).

    Lifetime: a unit's tensors are valid until the next unit is asked for, the iteration ends or
    the ``with`` block of ``export_weights`` exits, whichever comes first; then the engine may free
    or reuse their memory (FSDP reshards the unit). They are read-only: some are the engine's own
    parameters. A consumer that needs a tensor longer copies it. An engine keeps no reference to
    a unit it has moved past, so a consumer that keeps none either holds at most one unit of
    gathered weights, and one that copies into a bucket at most one bucket plus one unit.

    Asking for a unit is collective over the role's ranks: every rank of the role asks for the same
    units with the same ``dtype``, in order, to the end (``drain`` on a rank that needs none).
    """

    def __init__(self, manifest: list[tuple[str, torch.Size]],
                 produce: Callable[[torch.dtype | None], Iterator[Unit]]) -> None:
        self.manifest = manifest
        self._produce = produce
        self._open: list[Generator[object, None, None]] = []

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]]) -> WeightStream:
        """Tensors already in memory (nothing to gather), each its own unit: a cast copies one at a time."""
        held = list(named)

        def produce(dtype: torch.dtype | None) -> Iterator[Unit]:
            for name, t in held:
                yield [(name, t if dtype is None else t.to(dtype))]

        return cls([(n, t.shape) for n, t in held], produce)

    def merged(self, adapters: LoraConfig) -> WeightStream:
        """This stream of a PEFT-wrapped model (``model.lora``: ``adapters``; each unit holding an adapted
        weight with its adapters) as the base model's: every unit merged (``rlbatch.models.lora.merged``),
        under the base names."""
        scale = lora.scaling(adapters)
        return WeightStream(lora.base_shapes(self.manifest),
                            lambda dtype: (lora.merged(u, scale) for u in self._produce(dtype)))

    def units(self, dtype: torch.dtype | None = None) -> Iterator[Unit]:
        """The tensors unit by unit (see the class docstring); checked against the manifest."""
        inner = iter(self._produce(dtype))
        checked = self._checked(inner)
        if isinstance(inner, Generator):
            self._open.append(inner)
        self._open.append(checked)
        return checked

    def _checked(self, inner: Iterator[Unit]) -> Generator[Unit, None, None]:
        pos = 0
        for unit in inner:
            want = self.manifest[pos : pos + len(unit)]
            if [(n, t.shape) for n, t in unit] != want:
                raise RuntimeError(f"weight export: a unit gave {[(n, tuple(t.shape)) for n, t in unit][:3]}, the "
                                   f"manifest says {[(n, tuple(s)) for n, s in want][:3]} at position {pos}")
            pos += len(unit)
            yield unit
            del unit  # the unit is the consumer's until it asks for the next one, not longer
        if pos != len(self.manifest):
            raise RuntimeError(f"weight export: {pos} tensors came, the manifest lists {len(self.manifest)}")

    def tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors one by one; each valid until the iteration moves past its unit's last tensor."""
        units = self.units(dtype)
        for unit in units:
            yield from unit
            del unit

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.tensors()

    def drain(self, dtype: torch.dtype | None = None) -> None:
        """Take part in every unit's gather and keep nothing (a rank whose copy nobody loads)."""
        collections.deque(self.units(dtype), maxlen=0)  # holds no unit while the next is gathered

    def close(self) -> None:
        """End iterations left unfinished (their engines release what they hold, e.g. reshard)."""
        for gen in reversed(self._open):
            gen.close()
        self._open.clear()


def layer_units(names: list[str]) -> list[list[str]]:
    """Hugging Face names grouped as an engine that gathers per decoder layer streams them: each run of
    consecutive names of one layer (``model.layers.<i>.``) is a unit, and so is each run between layers
    (the embedding before them, the final norm and head after them)."""
    def layer(name: str) -> str | None:
        return name.split(".")[2] if name.startswith("model.layers.") else None

    return [list(run) for _, run in itertools.groupby(names, key=layer)]


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
        """Load (hf_name, full tensor) pairs into the model; returns bytes loaded. A sync may arrive in
        several calls (a unit or a bucket each). The engine has read the tensors when the call returns,
        or keeps copies of those it still needs: the caller may then free or overwrite their memory."""
        ...

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        """The model's own memory of these parameters as one 1-D ``dtype`` tensor when they lie back
        to back in it (receiving into it loads them), else None."""
        ...


@dataclass(frozen=True)
class TurnRequest:
    """One turn to generate: a trajectory's whole context so far (its prompt, the turns generated
    and the observations between them), under the caller's ``key``."""

    key: int
    tokens: list[int]
    seed: int
    """This request's own sampling seed, where the engine honours one (``Turns``)."""


class Turns(Protocol):
    """Requests that arrive and finish on their own: what a rollout of many multi-turn
    trajectories drives, so that a trajectory whose turn is done goes on (to its environment, then
    back with its next turn) while others still generate. ``turns_of`` gives it for any
    inference engine."""

    def submit(self, requests: list[TurnRequest], params: SamplingParams) -> None:
        """Start generating these (whatever else is in flight keeps going)."""
        ...

    def poll(self, block: bool = True) -> list[tuple[int, Generation]]:
        """The requests finished since the last poll, by key. ``block``: wait until at least one
        has finished (if any is in flight); else advance once and return what finished."""
        ...

    def in_flight(self) -> int:
        """Requests submitted and not yet returned by ``poll``."""
        ...


class BatchedTurns:
    """``Turns`` for an engine that only has ``generate`` (the hf engine): each poll generates
    every request submitted since the last in one call per sampling setting, so requests that
    arrive together are batched and none waits for a later one. One call samples from one RNG,
    seeded with its first request's seed: a request's tokens depend on what was batched with it."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.pending: list[tuple[TurnRequest, SamplingParams]] = []

    def submit(self, requests: list[TurnRequest], params: SamplingParams) -> None:
        self.pending += [(r, params) for r in requests]

    def poll(self, block: bool = True) -> list[tuple[int, Generation]]:
        out: list[tuple[int, Generation]] = []
        batch, self.pending = self.pending, []
        by_params: dict[SamplingParams, list[TurnRequest]] = {}
        for r, params in batch:
            by_params.setdefault(params, []).append(r)
        for params, requests in by_params.items():
            gens = self.engine.generate([r.tokens for r in requests], dataclasses.replace(params, seed=requests[0].seed))
            out += [(r.key, g) for r, g in zip(requests, gens, strict=True)]
        return out

    def in_flight(self) -> int:
        return len(self.pending)


def _has_turns(engine: InferenceEngine) -> TypeGuard[Turns]:
    """Whether ``engine`` has ``Turns``' methods too."""
    return all(callable(getattr(engine, m, None)) for m in ("submit", "poll", "in_flight"))


def turns_of(engine: InferenceEngine) -> Turns:
    """The engine itself where it implements ``Turns`` (vLLM: requests join and leave its running
    batch), else ``BatchedTurns`` over its ``generate``."""
    if _has_turns(engine):
        return engine
    return BatchedTurns(engine)


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

    def train(self, samples: list[Sample], objective: Objective) -> dict[str, float]:
        """One batch of updates (mini-batches x epochs) minimising ``objective``
        (``rlbatch.algos.objective``); returns averaged stats."""
        ...

    def export_weights(self) -> AbstractContextManager[WeightStream]:
        """Full weights as (hf_name, tensor), streamed unit by unit (``WeightStream``: its manifest, its
        units in a requested dtype, how long each stays valid). Nothing is gathered on entering the
        ``with`` block; iterating is collective over the role's ranks; the block's exit ends an
        unfinished iteration."""
        ...

    def checkpoint_state(self) -> CheckpointState | None:
        """The state to checkpoint (None for a forward-only engine). On load, the same call gives
        the tensors to read into, then ``load_checkpoint_state`` applies them."""
        ...

    def load_checkpoint_state(self, state: CheckpointState) -> None:
        ...


def build_engine(engine: str, ctx: EngineContext) -> Engine:
    """Build the registered implementation of ``engine`` (validation refused unbuilt ones)."""
    spec = spec_of(engine)
    if spec.implementation is None:
        raise NotImplementedError(f"engine '{engine}' is not built: {spec.note}")
    if ctx.head not in spec.heads:  # validation refused it too
        raise NotImplementedError(f"engine '{engine}', role {ctx.role}: a {ctx.head} head is not built")
    module, _, name = spec.implementation.partition(":")
    return getattr(importlib.import_module(module), name)(ctx)
