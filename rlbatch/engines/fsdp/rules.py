"""What the fsdp engine cannot split over tensor-parallel ranks (``fsdp:dXtY``, t > 1), said before
anything starts, with the numbers: attention heads and KV heads that t does not divide (each tp
rank computes whole heads), a Mixture-of-Experts model (its experts are not split), and low-rank
adapters (PEFT wraps the linear layers that tensor parallelism splits). The embedding and LM head
are never split over the vocabulary (a split embedding would untie a tied LM head), so the
vocabulary size needs no check. Under context parallelism (``fsdp:dXcZ``, c > 1; Ulysses, each
rank's heads after an all-to-all): heads that c does not divide, KV heads neither divisible by c
nor dividing it (they are repeated up to c), padded rows (``max_tokens_per_micro_batch=0``); with
t and c together, each tp rank's share of the heads over c. The engine refuses the same at build."""

from __future__ import annotations

from typing import Any

from rlbatch.config.schema import RLBatchConfig
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.registry import parse_args
from rlbatch.errors import ConfigError
from rlbatch.placement.backend import RoleEngine


def fsdp_problems(cfg: RLBatchConfig, engines: list[RoleEngine], placement: Any = None,
                  train_run: bool = True) -> list[str]:
    """One line per tensor-parallel split the fsdp engine does not build (``EngineSpec.rules``).
    Inherited backends are reported once, on actor_train."""
    from rlbatch.models.spec import spec_from_config

    mine = [e for e in engines if e.backend.engine == "fsdp" and not e.inherited and e.backend.dims.t > 1]
    split = [e for e in engines if e.backend.engine == "fsdp" and not e.inherited and e.backend.dims.c > 1]
    if not mine and not split:
        return []
    try:
        spec = spec_from_config(cfg.model)
    except (ConfigError, OSError, ValueError, TypeError):  # the model checks report it
        spec = None
    problems = [p for e in split for p in _context_problems(cfg, e, spec)]
    lora = cfg.model.lora
    for e in mine:
        b, t = e.backend, e.backend.dims.t
        field = f"roles.{e.role}.backend"
        if spec is not None:
            for name, n in (("num_heads", spec.heads), ("num_kv_heads", spec.kv_heads)):
                if n % t:
                    problems.append(f"{field}: '{b}' splits the model's attention by heads over tensor-parallel "
                                    f"ranks t={t}, but {name}={n} is not divisible by {t}")
            if spec.experts:
                problems.append(f"{field}: '{b}': the fsdp engine splits dense decoder layers over tensor-parallel "
                                f"ranks, and the model is a Mixture-of-Experts {spec.arch} with {spec.experts} "
                                f"routed experts; use t=1, or the megatron engine")
        # only a run this machine is to start: the planner prices such a layout as it would any other
        if train_run and e.role == "actor_train" and lora.rank > 0 and lora.dropout > 0:
            problems.append(f"{field}: '{b}' with model.lora.dropout={lora.dropout}: under tensor parallelism "
                            f"(t={t}) each rank of a column-split layer feeds the whole input to the adapter's A, "
                            f"which every rank holds whole; dropout would mask it differently on each rank and the "
                            f"copies of A would drift apart; use model.lora.dropout=0")
    return problems


def _context_problems(cfg: RLBatchConfig, e: RoleEngine, spec: Any) -> list[str]:
    b, c, t, field = e.backend, e.backend.dims.c, e.backend.dims.t, f"roles.{e.role}.backend"
    out = []
    # at t > 1, each tp rank's heads are what c splits (heads that t does not divide are refused above)
    if spec is not None and not (spec.heads % t or spec.kv_heads % t):
        if (spec.heads // t) % c:
            out.append(f"{field}: '{b}' gives each of c={c} context-parallel ranks whole attention heads, but "
                       f"num_heads={_share(spec.heads, t)} is not divisible by {c}")
        if (spec.kv_heads // t) % c and c % (spec.kv_heads // t):
            out.append(f"{field}: '{b}' splits key/value heads over c={c} context-parallel ranks (repeating them "
                       f"up to c), but num_kv_heads={_share(spec.kv_heads, t)} neither divides nor is divisible by {c}")
    args = parse_args("fsdp", cfg.roles[e.role].engine_args, f"roles.{e.role}.engine_args").value
    if isinstance(args, FSDPArgs) and args.max_tokens_per_micro_batch == 0:
        out.append(f"{field}: '{b}' splits packed rows over c={c} context-parallel ranks, but "
                   f"roles.{e.role}.engine_args.max_tokens_per_micro_batch=0 asks for padded ones; leave it unset "
                   f"or give a token budget")
    return out


def _share(heads: int, t: int) -> str:
    """A head count, and each tensor-parallel rank's share of it at t > 1 (what c splits)."""
    return f"{heads}" if t == 1 else f"{heads} ({heads // t} on each of t={t} tensor-parallel ranks)"
