"""What this build and this machine can run: the rules ``check(cfg)`` adds to the schema's.

The launcher's ``check(cfg)`` refuses, before anything starts or is submitted, what would fail
only once the ranks are up: an engine this build does not have, dims its engine does not split
over, a role given an engine of the wrong kind, a program that is not registered, a critic that
nothing uses, a reward model on GPUs, a model, dataset, reward function or checkpoint that is not
there, and (cluster=slurm) a run directory the compute nodes cannot see.
The planner's ``check(cfg, runnable=False)`` keeps only what holds in any build: placement,
schema, typed engine_args and the registered algorithm parts (and it accepts the programs it
models, such as PPO).

``program=selftest`` starts no engine and loads no model, data, reward function or checkpoint;
only the run directory rule applies to it.

No torch: the only imports are the modules the config names (``plugins``, ``data.reward_fn``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from rlbatch.algos.registry import PROGRAMS, USES_CRITIC, Registry
from rlbatch.config.schema import GPU_ROLES, HEADS, INHERIT_BACKEND
from rlbatch.engines.registry import REGISTRY, built_engines, parse_args
from rlbatch.errors import ConfigError
from rlbatch.phases import PHASES
from rlbatch.placement.backend import DIM_NAMES, BackendSpec, EngineKind, parse_backend

PLANNED_PROGRAMS: dict[str, str] = {}
"""Programs the planner models (``runnable=False`` accepts them) that this build cannot run."""

NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm")
"""Directories each node has its own of: a run directory there is invisible to the job's nodes."""

_KIND_WORD = {EngineKind.TRAIN: "training", EngineKind.INFER: "inference"}
_A = {EngineKind.TRAIN: "a", EngineKind.INFER: "an"}
_OP_KIND = {"generate": EngineKind.INFER, "logprobs": EngineKind.TRAIN, "values": EngineKind.TRAIN,
            "train": EngineKind.TRAIN, "score": EngineKind.TRAIN}


def section(plain: Mapping[str, Any], *keys: str) -> Mapping[str, Any]:
    """The mapping at ``plain[k1][k2]...``; empty where a key is missing or not a mapping."""
    node: Any = plain
    for key in keys:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else {}


def _enabled(rc: Any) -> TypeGuard[Mapping[str, Any]]:
    return isinstance(rc, Mapping) and rc.get("enabled", True) is not False


def registry_problem(registry: Registry, value: Any) -> str | None:
    if not isinstance(value, str):
        return f"{registry.field}: expected the name of a {registry.what}, got {type(value).__name__} {value!r}"[:200]
    return registry.problem(value)


def program_name_problem(name: Any, strict: bool) -> str | None:
    """algo.name: a registered program; with ``strict=False`` also one the planner models."""
    problem = registry_problem(PROGRAMS, name)
    if problem is None or not isinstance(name, str):
        return problem
    if name in PLANNED_PROGRAMS:
        return (f"algo.name: {name!r} is not built: {PLANNED_PROGRAMS[name]}; registered programs: {PROGRAMS.names()}"
                if strict else None)
    if strict or not PLANNED_PROGRAMS:
        return problem
    return f"{problem} (the planner also models {sorted(PLANNED_PROGRAMS)})"


@dataclass(frozen=True)
class RoleEngine:
    """A GPU role's parsed backend."""

    role: str
    backend: BackendSpec
    inherited: bool
    """The role has no backend of its own and takes actor_train's."""


def role_engines(plain: Mapping[str, Any]) -> list[RoleEngine]:
    """Every enabled GPU role whose backend parses (place() reports the ones that do not)."""
    roles = section(plain, "roles")
    train = roles.get("actor_train")
    train_backend = train.get("backend") if _enabled(train) else None
    out = []
    for name, rc in roles.items():
        if name not in (*GPU_ROLES, "reward") or not _enabled(rc):
            continue
        backend = rc.get("backend")
        inherited = name in INHERIT_BACKEND and backend in (None, "")
        if inherited:
            backend = train_backend
        if not isinstance(backend, str) or not backend.strip():
            continue
        try:
            out.append(RoleEngine(name, parse_backend(backend), inherited))
        except ConfigError:
            continue
    return out


def engine_args_problems(plain: Mapping[str, Any], engines: list[RoleEngine]) -> list[str]:
    """Each role's engine_args against its engine's typed arguments (unknown keys, wrong types)."""
    roles = section(plain, "roles")
    problems = []
    for e in engines:
        raw = roles[e.role].get("engine_args")
        if raw is None or isinstance(raw, Mapping):  # any other type: place() reports it
            problems += parse_args(e.backend.engine, raw, f"roles.{e.role}.engine_args").problems
    return problems


_HEAD_WORDS = {"value": ("value", "give the critic backend"),
               "reward": ("sequence-classification", "give the reward model")}
"""Per model head other than the policy's: what the head is called, and how to fix a backend without it."""


def head_problems(engines: list[RoleEngine]) -> list[str]:
    """A role whose model has a head of its own (``HEADS``: the critic's value head, a reward model's
    sequence-classification head) on an engine that does not build it (``EngineSpec.heads``)."""
    problems = []
    for e in engines:
        head, spec = HEADS.get(e.role, "lm"), REGISTRY.get(e.backend.engine)
        if spec is None or spec.kind is not EngineKind.TRAIN or head in spec.heads:
            continue  # an engine of the wrong kind: engine_problems says so
        word, fix = _HEAD_WORDS[head]
        able = " or ".join(f"'{n}:dN'" for n, s in REGISTRY.items() if s.built and head in s.heads)
        inherited = " (inherited from actor_train)" if e.inherited else ""
        problems.append(f"roles.{e.role}.backend: '{e.backend}'{inherited}: the {e.backend.engine} engine has no "
                        f"{word} head in this build; {fix} {able}")
    return problems


def _role_ops() -> dict[str, list[str]]:
    ops: dict[str, list[str]] = {}
    for p in PHASES.values():
        if p.op in _OP_KIND and p.op not in ops.setdefault(p.role, []):
            ops[p.role].append(p.op)
    return ops


def _dims_text(letters: str) -> str:
    return ", ".join(f"{x} ({DIM_NAMES[x]})" for x in letters)


def engine_problems(engines: list[RoleEngine]) -> list[str]:
    """Engines this build does not have, engines of the wrong kind for the role, dims above 1 the
    built engine does not support. Inherited backends are reported once, on actor_train."""
    ops = _role_ops()
    problems = []
    for e in engines:
        if e.inherited or e.role not in ops:
            continue
        field, b = f"roles.{e.role}.backend", e.backend
        need = _OP_KIND[ops[e.role][0]]
        built = built_engines(need)
        if b.kind is not need:
            problems.append(
                f"{field}: '{b}' names {_A[b.kind]} {_KIND_WORD[b.kind]} engine, but {e.role} runs "
                f"{' and '.join(ops[e.role])}, which needs {_A[need]} {_KIND_WORD[need]} engine; built: {built}")
            continue
        spec = REGISTRY.get(b.engine)
        if spec is None or not spec.built:
            why = (spec.note if spec is not None else "") or "no implementation is registered"
            problems.append(f"{field}: engine '{b.engine}' (in '{b}') is not built: {why}; "
                            f"built {_KIND_WORD[need]} engines: {built}")
            continue
        sections = [d for d in (b.attn, b.ffn) if d is not None] or [b.dims]
        bad = {x: getattr(d, x) for d in sections for x in "dtpce" if getattr(d, x) > 1 and x not in spec.dims}
        if bad:
            got = ", ".join(f"{x}={n}" for x, n in bad.items())
            why = f" ({spec.note})" if spec.note else ""
            problems.append(f"{field}: engine '{b.engine}' supports {_dims_text(spec.dims)} only in this build; "
                            f"got {got} in '{b}'{why}")
    return problems


def program_problems(plain: Mapping[str, Any]) -> list[str]:
    """program=train: the critic is used by the program, the reward role scores on CPUs. (algo.name
    itself is checked by ``check``, with ``program_name_problem``.)"""
    problems = []
    name = section(plain, "algo").get("name")
    roles = section(plain, "roles")
    if isinstance(name, str) and name in PROGRAMS and _enabled(roles.get("critic")) and name not in USES_CRITIC:
        problems.append(f"roles.critic: enabled, but algo.name={name} does not use a critic (programs that do: "
                        f"{sorted(USES_CRITIC)}); set roles.critic.enabled=false or algo=ppo")
    reward = roles.get("reward")
    sandbox_scores = _enabled(roles.get("code_sandbox"))
    if not _enabled(reward) and not sandbox_scores:
        problems.append("roles.reward: program=train scores every response with data.reward_fn on the reward "
                        "role's CPU workers; enable it, e.g. roles.reward.world_size=1")
    return problems


def _model_dir_problem(path: str, field: str = "model") -> str | None:
    p = Path(path).expanduser()
    hint = f"give a local Hugging Face model directory (nothing is downloaded), or set {field}.check_path=false " \
           "if only the compute nodes see it"
    if not p.exists():
        return f"{field}.path: {path} does not exist on this machine; {hint}"
    if not (p / "config.json").is_file():
        return f"{field}.path: {path} has no config.json, so it is not a Hugging Face model directory; {hint}"
    return None


def _data_file_problem(path: str) -> str | None:
    suffix = Path(path).suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        return f"data.path: {path} is not a .jsonl, .json or .parquet file"
    if not Path(path).expanduser().is_file():
        return (f"data.path: {path} does not exist on this machine; set data.check_path=false if only the "
                f"compute nodes see it")
    return None


def _reward_fn_problem(fn: Any) -> str | None:
    from rlbatch.rewards.rules import load_reward_fn

    try:
        load_reward_fn(fn)
    except ValueError as e:
        return f"data.reward_fn: {e}"
    except Exception as e:  # the user's module failed while importing
        return f"data.reward_fn: importing {fn!r} failed: {type(e).__name__}: {e}"[:400]
    return None


def _resume_problem(resume: str, run_dir: Any) -> str | None:
    from rlbatch.checkpoint.files import CHECKPOINTS
    from rlbatch.checkpoint.store import CheckpointError, open_checkpoint

    path = Path(resume).expanduser()
    tried = [str(path.absolute())]
    if not path.exists() and not path.is_absolute() and isinstance(run_dir, str) and run_dir:
        inside = Path(run_dir).expanduser() / CHECKPOINTS / resume
        tried.append(str(inside.absolute()))
        path = inside if inside.exists() else path
    if not path.exists():
        where = f"neither {tried[0]} nor {tried[1]} exists" if len(tried) > 1 else f"{tried[0]} does not exist"
        return f"resume: {resume!r} is not 'auto', 'never' or an existing checkpoint path ({where})"
    try:
        open_checkpoint(path, verify=False)  # manifests and file sizes; checksums are read when resuming
    except CheckpointError as e:
        return f"resume: {e}"
    return None


def files_problems(plain: Mapping[str, Any]) -> list[str]:
    """The model, dataset, reward function and checkpoint the config names are there."""
    model, data = section(plain, "model"), section(plain, "data")
    checks: list[tuple[str, Any]] = []
    if model.get("path") and model.get("check_path", True) is not False:
        checks.append(("model.path", lambda: _model_dir_problem(str(model["path"]))))
    for name in ("reward_model", "critic_model"):
        own = section(plain, name)
        if own.get("path") and own.get("check_path", True) is not False:
            checks.append((f"{name}.path", lambda p=str(own["path"]), f=name: _model_dir_problem(p, f)))
    if data.get("name") == "file" and data.get("path") and data.get("check_path", True) is not False:
        checks.append(("data.path", lambda: _data_file_problem(str(data["path"]))))
    if data.get("reward_fn") is not None and _enabled(section(plain, "roles").get("reward")):
        checks.append(("data.reward_fn", lambda: _reward_fn_problem(data["reward_fn"])))
    resume = plain.get("resume")
    if isinstance(resume, str) and resume not in ("", "auto", "never"):
        checks.append(("resume", lambda: _resume_problem(resume, plain.get("run_dir"))))
    problems = []
    for field, run in checks:
        try:
            problem = run()
        except (OSError, ValueError) as e:  # unreadable paths, names with NUL bytes
            problem = f"{field}: {e}"
        if problem:
            problems.append(problem[:400])
    return problems


def run_dir_problem(plain: Mapping[str, Any]) -> str | None:
    """cluster=slurm: a run directory under a node-local directory is invisible to the job's nodes."""
    run_dir = plain.get("run_dir")
    if section(plain, "cluster").get("name") != "slurm" or not isinstance(run_dir, str) or not run_dir:
        return None
    try:
        given = Path(run_dir).expanduser().absolute()
        seen = (given, given.resolve())
    except (OSError, ValueError, RuntimeError):
        return None
    for path in seen:
        for root in map(Path, NODE_LOCAL):
            if path == root or root in path.parents:
                return (f"run_dir: {given} is under {root}, which every node has its own of: the job's nodes "
                        f"would not see the config, placement and logs written there; put run_dir on a "
                        f"filesystem every node sees (home, project or scratch)")
    return None


def runnable_problems(plain: Mapping[str, Any], engines: list[RoleEngine]) -> list[str]:
    """Everything this build or this machine cannot run, one line each."""
    problems = []
    if plain.get("program", "train") == "train":
        from rlbatch.config.megatron_rules import megatron_problems

        problems += engine_problems(engines) + program_problems(plain) + files_problems(plain)
        problems += megatron_problems(plain, engines)
    if (problem := run_dir_problem(plain)) is not None:
        problems.append(problem)
    return problems
