"""What this build and this machine can run: the rules ``check(cfg)`` adds to the schema's.

The launcher's ``check(cfg)`` refuses, before anything starts or is submitted, what would fail
only once the ranks are up: an engine this build does not have, dims its engine does not split
over, a role given an engine of the wrong kind, a program that is not registered, a critic that
nothing uses, a reward model on GPUs, a model, dataset, reward function or checkpoint that is not
there (or a reward function that cannot be called as ``fn(completion, answer)``, a checkpoint that
fails its checksums), a run directory that cannot be made (empty, under a file, on a filesystem
the kernel provides such as /proc, not writable), (cluster=local) no mpiexec to start the ranks,
and (cluster=slurm) a run directory the compute nodes cannot see.
The planner's ``check(cfg, runnable=False)`` keeps only what holds in any build: placement,
schema, typed engine_args and the registered algorithm parts (and it accepts the programs it
models, such as PPO).

``program=selftest`` starts no engine and loads no model, data, reward function or checkpoint;
only the run directory and mpiexec rules apply to it.

No torch: the only imports are the modules the config names (``plugins``, ``data.reward_fn``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlbatch.algos.registry import LOOPS, USES_CRITIC, Registry
from rlbatch.config.schema import GPU_ROLES, HEADS, INHERIT_BACKEND, RLBatchConfig
from rlbatch.engines.registry import REGISTRY, EngineKind, built_engines, parse_args
from rlbatch.errors import ConfigError
from rlbatch.osinfo import mount_of, nearest_existing
from rlbatch.phases import PHASES
from rlbatch.placement.backend import DIM_NAMES, RoleEngine, parse_backend

PLANNED_PROGRAMS: dict[str, str] = {}
"""Programs the planner models (``runnable=False`` accepts them) that this build cannot run."""

NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm")
"""Directories each node has its own of: a run directory there is invisible to the job's nodes."""

KERNEL_FILESYSTEMS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                                "securityfs", "configfs", "bpf", "pstore", "efivarfs", "mqueue", "fusectl",
                                "binfmt_misc"})
"""Filesystems the kernel makes up rather than stores (/proc, /sys, /dev): no run directory can live
there, whatever the permission bits say (root passes every permission check on /proc)."""

_KIND_WORD = {EngineKind.TRAIN: "training", EngineKind.INFER: "inference"}
_A = {EngineKind.TRAIN: "a", EngineKind.INFER: "an"}
_OP_KIND = {"generate": EngineKind.INFER, "logprobs": EngineKind.TRAIN, "values": EngineKind.TRAIN,
            "train": EngineKind.TRAIN, "score": EngineKind.TRAIN}


def registry_problem(registry: Registry, value: Any) -> str | None:
    if not isinstance(value, str):
        return f"{registry.field}: expected the name of a {registry.what}, got {type(value).__name__} {value!r}"[:200]
    return registry.problem(value)


def program_name_problem(name: Any, strict: bool) -> str | None:
    """algo.name: a registered program; with ``strict=False`` also one the planner models."""
    problem = registry_problem(LOOPS, name)
    if problem is None or not isinstance(name, str):
        return problem
    if name in PLANNED_PROGRAMS:
        return (f"algo.name: {name!r} is not built: {PLANNED_PROGRAMS[name]}; registered programs: {LOOPS.names()}"
                if strict else None)
    if strict or not PLANNED_PROGRAMS:
        return problem
    return f"{problem} (the planner also models {sorted(PLANNED_PROGRAMS)})"




def role_engines(cfg: RLBatchConfig) -> list[RoleEngine]:
    """Every enabled GPU role whose backend parses (place() reports the ones that do not)."""
    train_backend = cfg.roles["actor_train"].backend if cfg.enabled("actor_train") else ""
    out = []
    for name, rc in cfg.roles.items():
        if name not in (*GPU_ROLES, "reward") or not rc.enabled:
            continue
        inherited = name in INHERIT_BACKEND and not rc.backend
        backend = train_backend if inherited else rc.backend
        if not backend.strip():
            continue
        try:
            out.append(RoleEngine(name, parse_backend(backend), inherited))
        except ConfigError:
            continue
    return out


def engine_args_problems(cfg: RLBatchConfig, engines: list[RoleEngine]) -> list[str]:
    """Each role's engine_args against its engine's typed arguments (unknown keys, wrong types)."""
    problems = []
    for e in engines:
        problems += parse_args(e.backend.engine, cfg.roles[e.role].engine_args, f"roles.{e.role}.engine_args").problems
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


def program_problems(cfg: RLBatchConfig) -> list[str]:
    """program=train: the critic is used by the program, the reward role scores on CPUs. (algo.name
    itself is checked by ``check``, with ``program_name_problem``.)"""
    problems = []
    name = cfg.algo.name
    if name in LOOPS and cfg.enabled("critic") and name not in USES_CRITIC:
        problems.append(f"roles.critic: enabled, but algo.name={name} does not use a critic (programs that do: "
                        f"{sorted(USES_CRITIC)}); set roles.critic.enabled=false or algo=ppo")
    if not cfg.enabled("reward") and not cfg.enabled("code_sandbox"):
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
        # Manifests, sizes and checksums, as the run checks them when it resumes: an explicit
        # checkpoint that fails would otherwise end the run after every rank has started.
        open_checkpoint(path)
    except CheckpointError as e:
        return f"resume: {e}; {_resume_hint(path, run_dir)}"
    return None


def _resume_hint(path: Path, run_dir: Any) -> str:
    """What to resume from instead of the checkpoint at ``path`` that failed: resume=auto where
    it is this run's own, the older complete checkpoints beside it by name, else resume=never."""
    from rlbatch.checkpoint.files import CHECKPOINTS, MANIFEST
    from rlbatch.checkpoint.store import CheckpointError, read_manifest

    single = (path / MANIFEST).exists() or re.fullmatch(r"step_\d+(\.tmp-.*)?", path.name) is not None
    root = path.parent if single else (path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path)
    failed = _step_of(path.name) if single else None
    older: list[tuple[int, str]] = []
    for p in root.iterdir() if root.is_dir() else ():
        step = _step_of(p.name)
        if step is None or p == path or (failed is not None and step >= failed):
            continue
        try:
            read_manifest(p)
        except CheckpointError:
            continue
        older.append((step, p.name))
    names = [n for _, n in sorted(older, reverse=True)]
    hints = []
    own = isinstance(run_dir, str) and run_dir and root.resolve() == (Path(run_dir).expanduser() / CHECKPOINTS).resolve()
    if own:
        hints.append("resume=auto resumes from this run's newest checkpoint that passes these checks")
    if names:
        listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        hints.append(f"{'or ' if hints else ''}name an older one, e.g. resume={root / names[0]} (older complete "
                     f"checkpoints in {root}: {listed})")
    elif single:
        hints.append(f"no older complete checkpoint is in {root}")
    hints.append("resume=never starts fresh")
    return "; ".join(hints)


def _step_of(name: str) -> int | None:
    m = re.fullmatch(r"step_(\d+)", name)
    return int(m.group(1)) if m else None


def files_problems(cfg: RLBatchConfig) -> list[str]:
    """The model, dataset, reward function and checkpoint the config names are there; then the data
    section's own rules (``rlbatch.checks.data_rules``: records, chat template, reward routes)."""
    model, data = cfg.model, cfg.data
    checks: list[tuple[str, Callable[[], str | None]]] = []
    if model.path and model.check_path:
        checks.append(("model.path", lambda: _model_dir_problem(str(model.path))))
    for name, own in (("reward_model", cfg.reward_model), ("critic_model", cfg.critic_model)):
        if own.path and own.check_path:
            checks.append((f"{name}.path", functools.partial(_model_dir_problem, own.path, name)))
    if data.name == "file" and data.path and data.check_path:
        checks.append(("data.path", lambda: _data_file_problem(str(data.path))))
    if cfg.enabled("reward"):
        from rlbatch.rewards.rules import reward_fn_problem

        checks.append(("data.reward_fn", lambda: reward_fn_problem(data.reward_fn, "data.reward_fn")))
    resume = cfg.resume
    if resume not in ("", "auto", "never"):
        checks.append(("resume", lambda: _resume_problem(resume, cfg.run_dir)))
    problems = []
    for field, run in checks:
        try:
            problem = run()
        except (OSError, ValueError) as e:  # unreadable paths, names with NUL bytes
            problem = f"{field}: {e}"
        if problem:
            problems.append(problem[:800])
    from rlbatch.checks.data_rules import data_problems

    problems += data_problems(cfg.data, cfg.model, reward_role=cfg.enabled("reward"))
    return problems


def run_dir_problems(cfg: RLBatchConfig, given: bool = True) -> list[str]:
    """The run directory can be made here (not empty, not a file or under one, not on a filesystem
    the kernel provides, writable), and with cluster=slurm is not node-local. Reads only: nothing
    is created until the run starts. ``given``: the config names one (a plain mapping of a test or
    the planner may leave the schema's default out)."""
    run_dir = cfg.run_dir
    if not given:
        return []
    if not run_dir.strip():
        try:
            here = f" ({Path.cwd()})"
        except OSError:
            here = ""
        return [f"run_dir: {run_dir!r} is empty: the run would write its config, logs and checkpoints into the "
                f"current directory{here}; give it a directory of its own, e.g. run_dir=runs/first"]
    problems = [p for p in (_run_dir_writable_problem(run_dir), _node_local_problem(cfg, run_dir)) if p]
    return problems[:1]  # a directory that cannot be made at all: where it is does not matter


def _run_dir_writable_problem(run_dir: str) -> str | None:
    """Why ``rlbatch.launch.rundir.prepare_run_dir`` could not make ``run_dir`` and write into it, judged on the path as it
    resolves there and on its nearest existing ancestor."""
    try:
        given = Path(run_dir).expanduser().resolve()
        probe = nearest_existing(given)
        kind = _not_a_directory(probe)
        mount = mount_of(probe)
        writable = os.access(probe, os.W_OK | os.X_OK)
        read_only = not writable and bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except (OSError, ValueError, RuntimeError) as e:  # unreadable ancestors, NUL bytes, symlink loops
        return f"run_dir: {run_dir!r} cannot be checked: {e}"
    if kind is not None:
        if probe == given:
            return f"run_dir: {given} is {kind}, not a directory; give a directory (or a path to create)"
        return f"run_dir: {given} cannot be created: {probe} is {kind}, not a directory"
    if mount is not None and mount.fstype in KERNEL_FILESYSTEMS:
        return (f"run_dir: {given} is under {mount.point}, a {mount.fstype} filesystem the kernel provides, where "
                f"nothing of a run can be written; put run_dir on a disk (home, project or scratch)")
    if not writable:
        what = given if probe == given else f"{given} cannot be created: {probe}"
        why = "is on a read-only filesystem" if read_only else "is not writable by this user"
        return f"run_dir: {what} {why}"
    return None


def _not_a_directory(path: Path) -> str | None:
    if path.is_dir():
        return None
    return "a regular file" if path.is_file() else "a special file"


def _node_local_problem(cfg: RLBatchConfig, run_dir: str) -> str | None:
    """cluster=slurm: a run directory under a node-local directory is invisible to the job's nodes."""
    if cfg.cluster.name != "slurm":
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


def locate_mpiexec(configured: str) -> str:
    """cluster.mpiexec, else the mpiexec installed beside this Python (the mpich wheel), else PATH's.

    The local launcher starts the ranks with it; validation calls it first, so a missing mpiexec
    is a configuration problem reported before anything is created. ConfigError when none runs.
    """
    beside = Path(sys.executable).parent / "mpiexec"
    if configured:
        found = shutil.which(configured)
        if found is not None:
            return found
        path = Path(configured).expanduser()
        why = ("is a directory" if path.is_dir() else "is not executable" if path.exists()
               else "does not exist" if os.sep in configured else "is not on PATH")
        fallback = shutil.which(str(beside)) or shutil.which("mpiexec")
        instead = f"leave it empty to use {fallback}" if fallback else "pip install mpich"
        raise ConfigError(f"cluster.mpiexec: {configured!r} {why}; give the path of an mpiexec, or {instead}")
    found = shutil.which(str(beside)) or shutil.which("mpiexec")
    if found is None:
        raise ConfigError(f"cluster.mpiexec: no mpiexec beside this Python ({beside}) or on PATH; pip install mpich, or "
                      f"set cluster.mpiexec to the path of one")
    return found


def mpiexec_problem(cfg: RLBatchConfig) -> str | None:
    """cluster=local (dry runs too: they print the command): the mpiexec that would start the ranks."""
    if cfg.cluster.name != "local":
        return None
    configured = cfg.cluster.mpiexec
    try:
        locate_mpiexec(configured)
    except ConfigError as e:
        return e.problems[0]
    except (OSError, ValueError) as e:  # a path with a NUL byte, an unreadable directory
        return f"cluster.mpiexec: {configured!r}: {e}"
    return None


MPICH_PMI2_BROKEN = 5
"""MPICH releases from this major version on (5.0.1, 5.0.2 tried) send each rank's UCX address to
Slurm's pmi2 server in lines it rejects, and MPI_Init under ``srun --mpi=pmi2`` hangs or aborts
(README, "MPI"); pyproject keeps the mpich wheel below it."""


def mpich_problem(cfg: RLBatchConfig) -> str | None:
    """cluster=slurm with cluster.mpi=pmi2: an mpich wheel of a version whose MPI_Init hangs under
    Slurm's pmi2 (installed by hand past pyproject's pin), refused before the job is submitted."""
    from importlib import metadata

    if cfg.cluster.name != "slurm" or cfg.cluster.mpi != "pmi2":
        return None
    try:
        version = metadata.version("mpich")
    except metadata.PackageNotFoundError:
        return None  # mpi4py uses the site's MPI
    major = version.split(".", 1)[0]
    if not major.isdigit() or int(major) < MPICH_PMI2_BROKEN:
        return None
    return (f"cluster.mpi: 'pmi2' with MPICH {version} (the mpich wheel in {sys.prefix}): its ranks hang or abort "
            f"in MPI_Init under srun --mpi=pmi2 (Slurm's PMI server rejects the addresses it sends); "
            f"pip install 'mpich<{MPICH_PMI2_BROKEN}', or use your site's MPI (README, \"MPI\")")


def runnable_problems(plain: Mapping[str, Any], cfg: RLBatchConfig, engines: list[RoleEngine]) -> list[str]:
    """Everything this build or this machine cannot run, one line each."""
    problems = []
    if cfg.program == "train":
        problems += engine_problems(engines) + program_problems(cfg) + files_problems(cfg)
    problems += run_dir_problems(cfg, given="run_dir" in plain)
    problems += [p for p in (mpiexec_problem(cfg), mpich_problem(cfg)) if p is not None]
    return problems


def engine_rule_problems(cfg: RLBatchConfig, engines: list[RoleEngine], placement: Any,
                         train_run: bool) -> list[str]:
    """Each engine's own checks (``EngineSpec.rules``), called once per engine in use with the typed
    config and the roles that run it, in the order the roles name the engines."""
    import importlib

    problems = []
    for name in dict.fromkeys(e.backend.engine for e in engines):
        spec = REGISTRY.get(name)
        if spec is None or spec.rules is None:
            continue
        module, _, fn = spec.rules.partition(":")
        problems += getattr(importlib.import_module(module), fn)(
            cfg, [e for e in engines if e.backend.engine == name], placement, train_run)
    return problems
