"""What the planner knows of each engine, registered with the engine (``EngineSpec.cost``).

An engine's cost model answers the planner's engine-specific questions: the memory its model's
state takes on a GPU and what its passes add, what it reads on the host while it is built, how its
passes cut prompts and sequences. ``rlbatch.plan.memory`` asks them through ``cost_of(engine)``
and never an engine's name, so an engine added by a plugin is planned by the cost model it brings:

    register(EngineSpec("myengine", EngineKind.TRAIN, MyArgs, "mypkg.engine:MyEngine",
                        cost="mypkg.plan:MyCost"))

``EngineCost`` holds the defaults (a training engine that gathers nothing, shares no prompts and
builds its model on the host); each built-in engine's model is its package's ``cost`` module
(``rlbatch/engines/<name>/cost.py``).
Torch-free, as the whole planner.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlbatch.engines.registry import spec_of
from rlbatch.plan.generation import generate

if TYPE_CHECKING:
    from rlbatch.config.hardware import Hardware
    from rlbatch.models.shape import ModelShape
    from rlbatch.plan.layout import Layout, RoleLayout
    from rlbatch.plan.memory import RoleMemory
    from rlbatch.plan.workload import Workload


@dataclass
class Held:
    """A training engine's memory on its most loaded GPU, apart from activations and logits."""

    state: dict[str, float]
    """Persistent bytes by kind (params, adapters, grads, optimizer)."""
    layers_held: int
    """Decoder layers on this GPU (a pipeline stage's)."""
    fwd_buffers: float = 0.0
    """Weight-gathering buffers of a forward-only pass."""
    train_buffers: float = 0.0
    """Weight-gathering and gradient buffers of a training pass."""
    buffer_term: str = "gather_buffers"
    """The transient term the buffers are reported under."""
    step_temp: float = 0.0
    """The optimizer step's temporaries (after the passes' transients are freed)."""
    sync_bytes: float = 0.0
    """What a weight sync gathers at a time."""
    notes: list[str] = field(default_factory=list)


class EngineCost:
    """The planner's model of one engine; the defaults are a generic training engine's."""

    def load_bytes(self, r: RoleLayout, shape: ModelShape, e: int, hw: Hardware) -> float:
        """Host bytes beyond its state while the engine is built (0: not modelled)."""
        return 0.0

    def units(self, r: RoleLayout, shape: ModelShape) -> int:
        """Units its weights are gathered in, one collective each: a unit per layer and the root."""
        return shape.layers + 1

    def shares_prompts(self, r: RoleLayout, w: Workload, mb: int, trained: bool) -> bool:
        """Whether a pass over ``mb`` sequences runs each distinct prompt once (then the responses
        on its cache)."""
        return False

    def sequence_parallel(self, r: RoleLayout) -> bool:
        """Whether tensor-parallel ranks split the sequence outside attention and MLP (Korthikanti's
        activation count divided by t)."""
        return False

    def vocab_split(self, r: RoleLayout) -> int:
        """Ranks the LM head's vocabulary (so a pass's logits) is split over: the tensor-parallel
        ranks (a vocabulary-parallel head), unless the engine keeps the head whole on each."""
        return r.backend.t if r.backend is not None else 1

    def outputs_over_cp(self, r: RoleLayout) -> bool:
        """Whether a context-parallel rank holds the final outputs (logits) of the whole sequence, gathered
        over cp, rather than of its own slice."""
        return False

    def gathers_each_pass(self, r: RoleLayout) -> bool:
        """Whether its weights are sharded and gathered unit by unit for every pass (FSDP, ZeRO-3)."""
        return False

    def reduces_each_step(self, r: RoleLayout) -> bool:
        """Whether, once per optimizer step, it reduce-scatters gradients and all-gathers the updated
        weights over dp (Megatron's distributed data parallel, ZeRO-1/2)."""
        return False

    continuous_batching = False
    """An inference engine whose decode batch shrinks as sequences finish, at a fixed host cost per
    step (vLLM, SGLang); otherwise a generate call keeps finished rows until its last one ends (hf)."""

    def generate(self, r: RoleLayout, mem: RoleMemory, shape: ModelShape, w: Workload, e: int, hw: Hardware,
                 layout: Layout) -> dict[str, float]:
        """An inference engine's generation (timing features): ``rlbatch.plan.generation.generate``'s
        prefill and decode model, with this engine's batching and prompt sharing."""
        return generate(r, mem, shape, w, e, hw, layout, self)

    def tensor_sizes(self, gpn: int) -> list[int]:
        """Tensor-parallel sizes ``plan search`` tries (powers of two within a node)."""
        return [1 << i for i in range(gpn.bit_length()) if (1 << i) <= gpn]

    def pipeline_sizes(self, t: int, gpn: int) -> list[int]:
        """Pipeline-parallel sizes ``plan search`` tries with tensor parallelism ``t``."""
        return [1]

    def expert_sizes(self, shape: ModelShape, t: int, d: int, gpn: int) -> list[int]:
        """Expert-parallel sizes ``plan search`` tries (over ``d`` data-parallel ranks)."""
        return [1]

    def tensor_split_problem(self, t: int, shape: ModelShape) -> bool:
        """Whether the engine cannot split the model's heads over ``t`` ranks (beyond t dividing them)."""
        return False

    def held(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, forward_only: bool) -> Held:
        """A training engine's state and buffers (``Held``)."""
        raise NotImplementedError(f"the planner has no memory model of {r.engine} as a training engine")

    def infer_memory(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
        """An inference engine's state and per-phase transients on its most loaded GPU."""
        raise NotImplementedError(f"the planner has no memory model of {r.engine} as an inference engine")


def cost_of(engine: str) -> EngineCost:
    """The cost model an engine's spec names (``EngineSpec.cost``, 'module:Class'); the defaults
    (``EngineCost``) for an engine that names none."""
    path = spec_of(engine).cost
    if path is None:
        return EngineCost()
    module, _, name = path.partition(":")
    cls: Any = getattr(importlib.import_module(module), name)
    return cls()
