"""What the megatron engine cannot split, said before anything starts: the model's layers over
pipeline stages, its attention heads and MLP over tensor-parallel ranks (the shape of ``model``:
its config.json, or the random-init fields), and the distributed optimizer with pipeline stages.
The engine refuses the same at build, with the same numbers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlbatch.config.runnable import RoleEngine
from rlbatch.config.schema import TRAINABLE_ROLES
from rlbatch.errors import ConfigError


def megatron_problems(plain: Mapping[str, Any], engines: list[RoleEngine]) -> list[str]:
    """One line per split that does not divide, and per trained role asking for the distributed
    optimizer with pipeline stages. Inherited backends are reported once, on actor_train."""
    from rlbatch.models.spec import spec_from_config

    mine = [e for e in engines if e.backend.engine == "megatron"]
    if not mine:
        return []
    try:
        spec = spec_from_config(plain.get("model") or {})
    except (ConfigError, OSError, ValueError, TypeError):  # the model checks report it
        spec = None
    roles = plain.get("roles") or {}
    problems = []
    for e in mine:
        b, d, field = e.backend, e.backend.dims, f"roles.{e.role}.backend"  # a hybrid spec's dims: attn's
        if spec is not None and not e.inherited:
            splits = (("layers", "num_layers", spec.layers, d.p, "pipeline stages p"),
                      ("attention", "num_heads", spec.heads, d.t, "tensor-parallel ranks t"),
                      ("attention", "num_kv_heads", spec.kv_heads, d.t, "tensor-parallel ranks t"),
                      ("MLP", "intermediate_size", spec.ffn, d.t, "tensor-parallel ranks t"))
            for what, name, n, by, axis in splits:
                if by > 1 and n % by:
                    problems.append(f"{field}: '{b}' splits the model's {what} over {axis}={by}, but {name}={n} "
                                    f"is not divisible by {by}")
        args = (roles.get(e.role) or {}).get("engine_args")
        if d.p > 1 and e.role in TRAINABLE_ROLES and isinstance(args, Mapping) and args.get("distributed_optimizer") is True:
            problems.append(f"roles.{e.role}.engine_args.distributed_optimizer: not built with pipeline parallelism "
                            f"(p={d.p} in '{b}'); set it to false or use megatron:dXtY")
    return problems
