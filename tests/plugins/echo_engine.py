"""An inference engine written only against the engine contract (``rlbatch.engines.base``) and
plugged in through the registry from this one file: ``plugins=[tests.plugins.echo_engine]`` and
``roles.actor_infer.backend=echo:d2``. Its own check before start and its model for the planner
come with it (``EngineSpec.rules``, ``EngineSpec.cost``): nothing outside this file names it.

It holds no model: each response is the prompt's last ``echo`` tokens and EOS, each sampled
token with log-prob 0 (the choice is certain). Weight sync hands it full weights, which it
counts and drops.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlbatch.config.hardware import Hardware
from rlbatch.engines.base import EngineContext, Generation, SamplingParams
from rlbatch.engines.offload import Transfer
from rlbatch.engines.registry import EngineSpec, register
from rlbatch.models.shape import ModelShape
from rlbatch.placement.backend import EngineKind
from rlbatch.plan.costs import EngineCost
from rlbatch.plan.layout import Layout, RoleLayout
from rlbatch.plan.memory import RoleMemory
from rlbatch.plan.workload import Workload


@dataclass(frozen=True)
class EchoArgs:
    echo: int = 3
    """How many of the prompt's last tokens each response repeats."""


class EchoEngine:
    state_kinds: tuple[str, ...] = ()

    def __init__(self, ctx: EngineContext) -> None:
        self.echo = ctx.args.echo
        self.eos = ctx.tokenizer.eos_token_id
        self.loaded_bytes = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for p in prompts:
            tokens = ([*p[-self.echo:], self.eos])[: params.max_new_tokens]
            out.append(Generation(tokens, [0.0] * len(tokens)))
        return out

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        self.loaded_bytes += nbytes
        return nbytes

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def offload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()

    def reload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()


def echo_problems(plain: Mapping[str, Any], roles: list[Any], placement: Any, train_run: bool) -> list[str]:
    """Its own check before start (``EngineSpec.rules``): an echo longer than a response may be."""
    longest = (plain.get("algo") or {}).get("max_new_tokens", 8)
    problems = []
    for r in roles:
        echo = ((plain.get("roles") or {}).get(r.role) or {}).get("engine_args", {}).get("echo", EchoArgs.echo)
        if isinstance(echo, int) and isinstance(longest, int) and echo + 1 > longest:
            problems.append(f"roles.{r.role}.engine_args.echo: {echo} tokens and EOS do not fit in "
                            f"algo.max_new_tokens={longest}")
    return problems


class EchoCost(EngineCost):
    """The planner's model of it (``EngineSpec.cost``): no weights on the device, a generation as
    long as its host work (one model-free step per response token)."""

    def infer_memory(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
        return RoleMemory(r.name, {"params": 0.0}, {"generate": {}, "sync": {}})

    def generate(self, r: RoleLayout, mem: RoleMemory, shape: ModelShape, w: Workload, e: int, hw: Hardware,
                 layout: Layout) -> dict[str, float]:
        return {"overhead": w.sequences * w.response_mean * hw.op_overhead_s, "fixed": 1.0}


register(EngineSpec("echo", EngineKind.INFER, EchoArgs, f"{__name__}:EchoEngine", dims="d",
                    rules=f"{__name__}:echo_problems", cost=f"{__name__}:EchoCost"))
