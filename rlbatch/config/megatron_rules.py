"""What the megatron engine cannot split, said before anything starts: the model's layers over
pipeline stages, its attention heads and MLP over tensor-parallel ranks (the shape of ``model``:
its config.json, or the random-init fields). The engine refuses the same at build, with the same
numbers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlbatch.config.runnable import RoleEngine
from rlbatch.errors import ConfigError


def megatron_problems(plain: Mapping[str, Any], engines: list[RoleEngine]) -> list[str]:
    """One line per split that does not divide. Inherited backends are reported once, on actor_train."""
    from rlbatch.models.spec import spec_from_config

    mine = [e for e in engines if e.backend.engine == "megatron" and not e.inherited]
    if not mine:
        return []
    try:
        spec = spec_from_config(plain.get("model") or {})
    except (ConfigError, OSError, ValueError, TypeError):  # the model checks report it
        return []
    problems = []
    for e in mine:
        b, d = e.backend, e.backend.dims  # a hybrid spec's dims: attn's
        splits = (("layers", "num_layers", spec.layers, d.p, "pipeline stages p"),
                  ("attention", "num_heads", spec.heads, d.t, "tensor-parallel ranks t"),
                  ("attention", "num_kv_heads", spec.kv_heads, d.t, "tensor-parallel ranks t"),
                  ("MLP", "intermediate_size", spec.ffn, d.t, "tensor-parallel ranks t"))
        for what, name, n, by, axis in splits:
            if by > 1 and n % by:
                problems.append(f"roles.{e.role}.backend: '{b}' splits the model's {what} over {axis}={by}, but "
                                f"{name}={n} is not divisible by {by}")
    return problems
