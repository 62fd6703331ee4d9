"""The echo engine's own check before start (``EngineSpec.rules``)."""

from __future__ import annotations

from typing import Any

from rlbatch.config.schema import RLBatchConfig
from rlbatch.engines.registry import parse_args
from tests.plugins.echo import EchoArgs


def echo_problems(cfg: RLBatchConfig, roles: list[Any], placement: Any, train_run: bool) -> list[str]:
    """Its own check before start (``EngineSpec.rules``): an echo longer than a response may be."""
    longest = cfg.algo.max_new_tokens
    problems = []
    for r in roles:
        args = parse_args("echo", cfg.roles[r.role].engine_args, f"roles.{r.role}.engine_args").value
        echo = args.echo if isinstance(args, EchoArgs) else EchoArgs.echo
        if echo + 1 > longest:
            problems.append(f"roles.{r.role}.engine_args.echo: {echo} tokens and EOS do not fit in "
                            f"algo.max_new_tokens={longest}")
    return problems
