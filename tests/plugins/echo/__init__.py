"""A test engine shaped as a built-in one (``rlbatch/engines/<name>/``), plugged in through the
registry from this package alone: ``plugins=[tests.plugins.echo]`` and
``roles.actor_infer.backend=echo:d2``. Its spec and typed engine_args are here, beside the one
``register`` line; the engine is ``engine``, its own check before start ``rules``, its model for the
planner ``cost``: nothing outside this package names it.

It holds no model: each response is the prompt's last ``echo`` tokens and EOS, each sampled
token with log-prob 0 (the choice is certain). Weight sync hands it full weights, which it
counts and drops.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.engines.registry import EngineKind, EngineSpec, register


@dataclass(frozen=True)
class EchoArgs:
    echo: int = 3
    """How many of the prompt's last tokens each response repeats."""


register(EngineSpec("echo", EngineKind.INFER, EchoArgs, f"{__name__}.engine:EchoEngine", dims="d",
                    rules=f"{__name__}.rules:echo_problems", cost=f"{__name__}.cost:EchoCost"))
