"""The echo engine's own check before start (``EngineSpec.rules``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.plugins.echo import EchoArgs


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
