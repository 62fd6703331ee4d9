"""Which engines there are, what each accepts, and where its implementation lives: the one table of
engines. A backend string may name any engine registered here (``rlbatch.placement.backend``);
its spec says the dims it supports, its typed ``engine_args``, how the loop dispatches samples to
its ranks, its rules and its cost model. An engine is added by one ``register(EngineSpec(...))``
call in its package (``rlbatch/engines/<name>/__init__.py``, or a plugin module listed in the
config's ``plugins``); nothing else changes.

Torch-free, so validation, the launcher and the planner read it without importing an engine.

    python -c "from rlbatch.engines.registry import describe; print(describe())"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rlbatch.config.bounds import RANGE, Range, value_problem


class EngineKind(str, Enum):
    TRAIN = "train"
    INFER = "infer"


AT_LEAST_ZERO = Range(ge=0)
"""The range of a numeric engine arg that declares none (``bounded`` declares one): sizes, counts
and fractions are never negative, and every one is finite and within what torch holds."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine as this build knows it."""

    name: str
    kind: EngineKind
    args: type
    """Dataclass of its engine_args: every key a user may set, typed, with a default and a doc."""
    implementation: str | None = None
    """'module:Class' implementing the engine Protocol; None when this build does not run it."""
    dims: str = "d"
    """Dims (letters of 'dtpce') this implementation supports with a size above 1."""
    planned_dims: str | None = None
    """Dims a backend string may name beyond ``dims``, for plans the planner models though this build
    does not run them (validation refuses them with ``note``); None: ``dims``."""
    data_axes: tuple[str, ...] = ("dp",)
    """Mesh axes over which samples are split: ranks that differ only in other axes (tp, pp, cp
    peers of one replica) receive the same samples."""
    note: str = ""
    """Why it is not built, or what is missing, for error messages."""
    heads: tuple[str, ...] = ("lm",)
    """The model heads it builds (``rlbatch.config.schema.HEADS``): 'lm' (the policy), 'value' (a
    critic), 'reward' (a sequence-classification reward model)."""
    reserves_device_share: bool = False
    """At start-up it reserves a share of the device's memory for itself and refuses to start when
    that much is not free (vLLM's gpu_memory_utilization): on a rank shared with other engines it
    is built before them, while the device is empty."""
    packs_rows: bool = False
    """Under a token budget (engine_args.max_tokens_per_micro_batch, resolved by
    ``rlbatch.engines.defaults.max_tokens_per_micro_batch``) it packs each micro-batch's samples
    into one unpadded row, the LM head only at scored positions: what the planner models."""

    loads_in_flight: bool = False
    """Weights can land while it generates (``algo.in_flight_updates``): it pauses between engine
    steps, loads them and goes on with the same sequences, recording each token's policy version."""
    in_flight_tp: str = ""
    """How it takes weights mid-generation on a worker of several tensor-parallel ranks: "lockstep"
    (each rank's engine steps in lockstep in the rank's own process, so the ranks agree before each
    step whether a sync lands: ``rlbatch.loop.weightsync.InFlightSync.agreed``), "leader" (the
    worker's first rank runs the engine, the others hold no model and join each sync as it begins
    while they wait for its generations); "" where it cannot (refused before start)."""
    trains_adapters: bool = False
    """It trains low-rank adapters of the model (``model.lora``) and exports them merged
    (``export_weights``) or alone (``export_adapters``, for an engine that ``loads_adapters``)."""
    rules: str | None = None
    """'module:function' of its own checks before start, ``fn(cfg, roles, placement, train_run)
    -> problems``: ``cfg`` the typed config (``rlbatch.config.schema.RLBatchConfig``; a role's
    ``engine_args`` as written, typed by ``parse_args``), ``roles`` the roles that run this engine
    (``rlbatch.placement.backend.RoleEngine``), ``placement`` (None when placement failed),
    ``train_run`` whether this machine is to run the training (a runnable check of program=train).
    Validation calls it for every engine in use (``rlbatch.checks.runnable.engine_rule_problems``)."""
    cost: str | None = None
    """'module:Class' of the planner's model of the engine (``rlbatch.plan.costs.EngineCost``): its
    memory and what its passes cost; None: the generic defaults."""
    loads_adapters: bool = False
    """An inference engine that generates with low-rank adapters beside its base weights, so a
    ``model.lora`` policy's weight sync moves the adapters alone (``model.lora.sync``): the trainer
    streams them through its ``export_adapters``, the engine takes them through its
    ``load_adapters(named) -> bytes`` (PEFT's names, in buckets, as ``load_weights`` takes weights)."""
    needs_torch_world: bool = True
    """Its ranks need the torch.distributed world (process groups, device meshes, collectives). A run
    none of whose engines does (and whose weight sync stays within each rank) starts none, and
    moves its samples over MPI (``rlbatch.runtime.world.needs_torch_world``)."""
    sync_check_floor: float = 1e-2
    """An inference engine's floor for the checked sync (``rlbatch.loop.synccheck``): the mean
    |log-prob difference| from the trainer's, over the probe's tokens, that a sync may always show
    (its tolerance is the larger of this and a multiple of the pair's mismatch measured before
    training). Set it above what the engine's numerics alone give against a trainer that holds the
    same weights, in the precision it runs at; the generous default suits an engine never measured."""

    @property
    def built(self) -> bool:
        return self.implementation is not None


REGISTRY: dict[str, EngineSpec] = {}


def register(spec: EngineSpec) -> EngineSpec:
    """Add (or replace) an engine; backend strings may name it from then on."""
    if not dataclasses.is_dataclass(spec.args):
        raise TypeError(f"engine {spec.name!r}: args must be a dataclass type, got {spec.args!r}")
    if spec.name in REGISTRY and REGISTRY[spec.name].kind is not spec.kind:
        raise ValueError(f"engine {spec.name!r} is a {REGISTRY[spec.name].kind.value} engine, registered again as "
                         f"{spec.kind.value}")
    REGISTRY[spec.name] = spec
    return spec


def spec_of(name: str) -> EngineSpec:
    if name not in REGISTRY:
        raise KeyError(f"engine {name!r} is not registered; registered engines: {sorted(REGISTRY)}")
    return REGISTRY[name]


def built_engines(kind: EngineKind | None = None) -> list[str]:
    return sorted(n for n, s in REGISTRY.items() if s.built and (kind is None or s.kind is kind))


@dataclass
class ArgsCheck:
    """The result of reading one role's engine_args: the typed value, or the problems."""

    value: Any = None
    problems: list[str] = field(default_factory=list)


def _coerce(value: Any, annotation: Any) -> tuple[Any, bool]:
    """The value as the field's type; False when it is not of that type (no string parsing: YAML and
    Hydra already typed it)."""
    t = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if t.endswith(" | None"):  # optional: unset (None) is the engine's default
        return (None, True) if value is None else _coerce(value, t.removesuffix(" | None"))
    if t == "bool":
        return value, isinstance(value, bool)
    if t == "int":
        return value, isinstance(value, int) and not isinstance(value, bool)
    if t == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return (float(value) if ok else value), ok
    if t == "str":
        return value, isinstance(value, str)
    return value, True


def parse_args(engine: str, raw: Mapping[str, Any] | None, where: str) -> ArgsCheck:
    """Typed engine_args for ``engine`` from the role's mapping. Unknown keys and wrong types are
    problems naming ``where`` (e.g. 'roles.actor_train.engine_args'), the key and what is accepted."""
    spec = REGISTRY.get(engine)
    if spec is None:
        return ArgsCheck(None, [])
    raw = dict(raw or {})
    fields = {f.name: f for f in dataclasses.fields(spec.args)}
    problems = []
    unknown = sorted(str(k) for k in raw if k not in fields)
    if unknown:
        problems.append(f"{where}: unknown key(s) {unknown} for engine '{engine}'; it accepts {sorted(fields)}")
    values = {}
    for k, v in raw.items():
        if k not in fields:
            continue
        coerced, ok = _coerce(v, fields[k].type)
        if not ok:
            want = fields[k].type if isinstance(fields[k].type, str) else getattr(fields[k].type, "__name__", fields[k].type)
            problems.append(f"{where}.{k}: expected {want}, got {type(v).__name__} {v!r}"[:200])
        elif isinstance(coerced, (int, float)) and not isinstance(coerced, bool) and (problem := value_problem(
                f"{where}.{k}", coerced, type(coerced), fields[k].metadata.get(RANGE, AT_LEAST_ZERO))) is not None:
            problems.append(problem)
        else:
            values[k] = coerced
    if problems:
        return ArgsCheck(None, problems)
    try:
        return ArgsCheck(spec.args(**values), [])
    except ValueError as e:  # a value the args refuse (their __post_init__): "<key>: <why>"
        return ArgsCheck(None, [f"{where}.{e}"])


def engine_args(engine: str, raw: Mapping[str, Any] | None) -> Any:
    """Typed engine_args (validated before launch; raises ValueError if they are not)."""
    checked = parse_args(engine, raw, "engine_args")
    if checked.problems:
        raise ValueError("; ".join(checked.problems))
    return checked.value


def describe() -> str:
    lines = []
    for name in sorted(REGISTRY):
        s = REGISTRY[name]
        state = f"built, dims {s.dims}" if s.built else f"not built{': ' + s.note if s.note else ''}"
        keys = ", ".join(f.name for f in dataclasses.fields(s.args))
        heads = f"; heads: {', '.join(s.heads)}" if s.kind is EngineKind.TRAIN else ""
        lines.append(f"{name:10s} {s.kind.value:6s} {state}{heads}; engine_args: {keys or '-'}")
    return "\n".join(lines)
