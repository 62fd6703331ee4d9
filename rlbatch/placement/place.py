"""``place(cfg) -> Placement``: validate the roles and cluster of a config and place them.

Pure: no torch, no engines, no GPUs, no I/O. Every problem found is collected and raised as one
ConfigError, each naming role, field and numbers, so a user fixes a config in one pass.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from rlbatch.config.schema import GPU_ROLES, INHERIT_BACKEND, INHERIT_DEVICE_MAPPING, RLBatchConfig, RoleConfig
from rlbatch.engines.registry import EngineKind
from rlbatch.errors import ConfigError
from rlbatch.phases import reference_is_actor_base
from rlbatch.placement.backend import BackendSpec, parse_backend
from rlbatch.placement.device_mapping import MAX_GPUS, parse_device_mapping
from rlbatch.placement.placement import (
    Placement,
    ProcessKind,
    ProcessSlot,
    RolePlacement,
    SlurmRequest,
)

REQUIRED_ROLES = ("actor_train", "actor_infer")
MAX_CPU_WORKERS = 4096


def _int_field(value: int | None, field: str, problems: list[str], minimum: int = 1,
               maximum: int | None = None) -> int | None:
    """A role's count, typed by the parse, in the range its kind of role allows."""
    if value is None:
        return None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        problems.append(f"{field}: must be {bound}, got {value}")
        return None
    return value


@dataclasses.dataclass
class _GpuRole:
    name: str
    backend: BackendSpec
    ranks: list[int]
    ngpw: int
    world: int
    offload: bool
    engine_args: dict[str, Any]
    inherits_mapping: bool = False
    """The device_mapping is actor_train's (colocated by default): its ranks are reported there."""


@dataclasses.dataclass
class _CpuRole:
    name: str
    world: int
    offload: bool
    engine_args: dict[str, Any]


def _check_gpu_role(
    name: str, rc: RoleConfig, backend_str: str, inherited: bool, problems: list[str], refused: Sequence[str]
) -> _GpuRole | None:
    f = f"roles.{name}"
    n0 = len(problems)
    backend = ranks = None
    if not backend_str:
        hint = " (and actor_train has none to inherit)" if name in INHERIT_BACKEND else ""
        if not any(p.startswith(f"{f}.backend:") for p in refused):  # not when the parse refused the one given
            problems.append(f"{f}.backend: a GPU role needs a backend such as 'fsdp:d2'{hint}")
    else:
        try:
            label = f"{f}.backend (inherited from actor_train)" if inherited else f"{f}.backend"
            backend = parse_backend(backend_str, label)
        except ConfigError as e:
            problems.extend(e.problems)
    try:
        ranks = parse_device_mapping(rc.device_mapping, f"{f}.device_mapping")
    except ConfigError as e:
        problems.extend(e.problems)
    ngpw = _int_field(rc.num_gpus_per_worker, f"{f}.num_gpus_per_worker", problems)
    world = _int_field(rc.world_size, f"{f}.world_size", problems, maximum=MAX_GPUS)
    if backend is None or ranks is None or len(problems) > n0:
        return None

    n = len(ranks)
    expected = backend.num_gpus_per_worker
    kind = "training" if backend.kind is EngineKind.TRAIN else "inference"
    if ngpw is not None and ngpw != expected:
        why = "training engines use 1 GPU per worker" if backend.kind is EngineKind.TRAIN else f"t*p = {backend.t}*{backend.p}"
        problems.append(f"{f}.num_gpus_per_worker: is {ngpw} but backend '{backend}' ({kind}) needs {expected} ({why})")
    elif ngpw is None and world is not None:
        if n % world:
            problems.append(f"{f}.world_size: device_mapping has {n} GPUs, not divisible by world_size={world}")
        elif n // world != expected:
            problems.append(
                f"{f}.world_size: {n} GPUs / world_size={world} gives {n // world} GPUs per worker, "
                f"but backend '{backend}' ({kind}) needs {expected}"
            )
    ngpw = expected
    if n % ngpw:
        problems.append(f"{f}: device_mapping has {n} GPUs, not divisible by num_gpus_per_worker={ngpw}")
    elif world is not None and world != n // ngpw:
        problems.append(f"{f}.world_size: is {world} but device_mapping has {n} GPUs / {ngpw} per worker = {n // ngpw} workers")
    if n != backend.world_size:
        d = backend.dims
        problems.append(
            f"{f}: device_mapping has {n} GPUs but backend '{backend}' needs "
            f"d*t*p*c = {d.d}*{d.t}*{d.p}*{d.c} = {backend.world_size}"
        )
    if len(problems) > n0:
        return None
    return _GpuRole(name, backend, ranks, ngpw, n // ngpw, rc.offload, rc.engine_args)


def _groups_within_nodes(role: _GpuRole, gpn: int, problems: list[str]) -> None:
    """Tensor- and expert-parallel groups need NVLink: each must sit inside one node."""
    b, ranks, f = role.backend, role.ranks, f"roles.{role.name}"

    def check(groups: list[list[int]], what: str) -> None:
        for g in groups:
            nodes = sorted({r // gpn for r in g})
            if len(nodes) > 1:
                problems.append(
                    f"{f}: {what} group of GPU ranks {g} spans nodes {nodes} "
                    f"(gpus_per_node={gpn}); keep it inside one node"
                )
                return

    if b.t > 1:
        check([ranks[i : i + b.t] for i in range(0, len(ranks), b.t)], f"tensor-parallel (t={b.t})")
    if b.ffn is not None:
        ffn = b.ffn
        if ffn.e > 1:
            block = ffn.e * ffn.t  # mesh (pp, dp, ep, tp): an EP group strides tp inside a block
            groups = [ranks[i + j : i + block : ffn.t] for i in range(0, len(ranks), block) for j in range(ffn.t)]
            check(groups, f"expert-parallel (e={ffn.e})")
        if ffn.t > 1 and ffn.t != b.t:
            check([ranks[i : i + ffn.t] for i in range(0, len(ranks), ffn.t)], f"ffn tensor-parallel (t={ffn.t})")
    elif b.e > 1:
        per_stage = b.d * b.t * b.c
        if per_stage % b.e:
            problems.append(
                f"{f}.backend: expert parallel e={b.e} must divide the GPUs of one pipeline stage "
                f"d*t*c = {b.d}*{b.t}*{b.c} = {per_stage} in '{b}'"
            )
        else:
            check([ranks[i : i + b.e] for i in range(0, len(ranks), b.e)], f"expert-parallel (e={b.e})")


def _mesh(b: BackendSpec) -> tuple[tuple[str, int], ...]:
    if b.kind is EngineKind.TRAIN:
        return (("pp", b.p), ("dp", b.d), ("cp", b.c), ("tp", b.t))
    return (("dp", b.d), ("pp", b.p), ("tp", b.t))


def _read_roles(roles: Mapping[str, RoleConfig], problems: list[str],
                refused: Sequence[str]) -> tuple[list[_GpuRole], list[_CpuRole]]:
    enabled = {name: rc for name, rc in roles.items() if rc.enabled}
    for name in REQUIRED_ROLES:
        if name not in enabled:
            problems.append(f"roles.{name}: required for RL training but missing or disabled")

    train = enabled.get("actor_train")
    train_backend, train_mapping = (train.backend, train.device_mapping) if train is not None else ("", None)
    gpu: list[_GpuRole] = []
    cpu: list[_CpuRole] = []
    for name, rc in enabled.items():
        f = f"roles.{name}"
        inherits = name in INHERIT_DEVICE_MAPPING and rc.device_mapping is None and rc.world_size is None
        if inherits:
            rc = dataclasses.replace(rc, device_mapping=train_mapping)  # colocated with actor_train
        inherited = name in INHERIT_BACKEND and not rc.backend
        backend_str = train_backend if inherited else rc.backend
        has_dm = rc.device_mapping is not None
        wants_gpu = name in GPU_ROLES or (name == "reward" and (has_dm or backend_str))
        if wants_gpu:
            if not has_dm and rc.world_size is None:
                problems.append(f"{f}: has neither device_mapping nor world_size; a GPU role needs device_mapping")
            elif not has_dm:
                problems.append(f"{f}.device_mapping: missing; world_size alone describes a CPU role, but {name} runs a model on GPUs")
            elif (r := _check_gpu_role(name, rc, backend_str, inherited, problems, refused)) is not None:
                r.inherits_mapping = inherits
                gpu.append(r)
            continue
        asks = [k for k, v in (("device_mapping", rc.device_mapping), ("backend", rc.backend)) if v not in (None, "")]
        if rc.num_gpus_per_worker not in (None, 0):
            asks.append(f"num_gpus_per_worker={rc.num_gpus_per_worker}")
        if asks:
            problems.append(f"{f}: is a CPU role but asks for GPUs ({', '.join(asks)}); give it only world_size")
            continue
        if rc.world_size is None:
            problems.append(f"{f}: has neither device_mapping nor world_size; a CPU role needs world_size")
            continue
        world = _int_field(rc.world_size, f"{f}.world_size", problems, maximum=MAX_CPU_WORKERS)
        if world is not None:
            cpu.append(_CpuRole(name, world, rc.offload, rc.engine_args))
    return gpu, cpu


def _colocated_sets(gpu: list[_GpuRole]) -> list[tuple[str, ...]]:
    parent = {r.name: r.name for r in gpu}

    def find(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    owner: dict[int, str] = {}
    for r in gpu:
        for g in r.ranks:
            if g in owner:
                parent[find(r.name)] = find(owner[g])
            else:
                owner[g] = r.name
    sets: dict[str, list[str]] = {}
    for r in gpu:
        sets.setdefault(find(r.name), []).append(r.name)
    return [tuple(s) for s in sets.values() if len(s) > 1]


def place(cfg: RLBatchConfig | Mapping[str, Any], parse_problems: Sequence[str] = ()) -> Placement:
    """Validate the roles and the cluster of ``cfg`` (the typed config, or plain mappings that
    ``rlbatch.config.parse`` reads first, its problems of roles and cluster raised with this one's)
    and place every role. Raises ConfigError. ``parse_problems``: what the parse of a typed ``cfg``
    reported, which its caller reports (a field it refused is not reported again as missing)."""
    raised: list[str] = []
    if not isinstance(cfg, RLBatchConfig):
        from rlbatch.config.parse import parse

        result = parse(cfg)
        cfg, parse_problems = result.config, result.problems
        raised = [p for p in parse_problems if p.startswith(("roles", "cluster"))]
    problems: list[str] = []
    cluster = cfg.cluster
    gpn, nodes_cfg, cpus = cluster.gpus_per_node, cluster.nodes, cluster.cpus_per_task
    roles, unplaced = _without_base_reference(cfg)
    gpu, cpu = _read_roles(roles, problems, parse_problems)

    used = sorted({g for r in gpu for g in r.ranks})
    problems += _idle_reference_ranks(unplaced, used)
    num_gpus = used[-1] + 1 if used else 0
    problems += _rank_problems(gpu, used, gpn, nodes_cfg)
    num_nodes = max(1, -(-num_gpus // gpn)) if nodes_cfg is None else nodes_cfg
    for r in gpu:
        _groups_within_nodes(r, gpn, problems)
    if raised or problems:
        raise ConfigError(raised + problems)
    return _build(gpu, cpu, gpn, num_nodes, num_gpus, cpus)


def _without_base_reference(cfg: RLBatchConfig) -> tuple[dict[str, RoleConfig], RoleConfig | None]:
    """``cfg.roles`` without the reference role when its log-probs are the trained policy's base
    model's (``model.lora``: ``reference_is_actor_base``), and the reference's config so left out
    (None when it was not)."""
    ref = cfg.roles.get("reference")
    if not reference_is_actor_base(cfg.model.lora) or ref is None or not ref.enabled:
        return cfg.roles, None
    return {k: v for k, v in cfg.roles.items() if k != "reference"}, ref


def _idle_reference_ranks(ref: RoleConfig | None, used: list[int]) -> list[str]:
    """A reference left out for the policy's base (``_without_base_reference``) whose own GPU ranks
    no placed role uses: refused, as those GPUs would be requested for nothing (or leave a gap)."""
    if ref is None or ref.device_mapping is None:
        return []
    try:
        ranks = parse_device_mapping(ref.device_mapping, "roles.reference.device_mapping")
    except ConfigError:
        return []  # nothing of it is placed: its mapping's own mistakes do not matter
    taken = set(used)
    if not (idle := sorted({g for g in ranks if g not in taken})):
        return []
    return [f"roles.reference.device_mapping: GPU ranks {_ranges([(g, g) for g in idle], 8)} are the reference's "
            f"alone, but with model.lora the reference's log-probs are actor_train's base model's (its adapters "
            f"off, on actor_train's ranks) and no reference role is placed; set roles.reference.enabled=false "
            f"or give those GPUs to another role"]


def _rank_problems(gpu: list[_GpuRole], used: list[int], gpn: int, nodes_cfg: int | None) -> list[str]:
    """GPU ranks beyond the cluster (with cluster.nodes) and ranks that leave a gap, each reported
    on the role that names them, with the cluster's GPUs: a typo such as [0, 1000] is that role's
    problem, not the 998 ranks it skips. Ranks may be sparse and huge: no range of them is built."""
    problems = []
    own = [r for r in gpu if not r.inherits_mapping]  # an inherited mapping is reported on actor_train
    size = None if nodes_cfg is None else nodes_cfg * gpn
    cluster = "" if size is None else f"nodes={nodes_cfg} x gpus_per_node={gpn} = {size} GPUs (ranks 0..{size - 1})"
    if size is not None:
        for r in own:
            if beyond := [g for g in r.ranks if g >= size]:
                problems.append(f"roles.{r.name}.device_mapping: GPU ranks {beyond[:8]} are beyond the cluster: {cluster}")
        used = [g for g in used if g < size]
    gaps = [(a + 1, b - 1) for a, b in itertools.pairwise([-1, *used]) if b > a + 1]
    if not gaps:
        return problems
    first = gaps[0][0]
    skipped = _ranges(gaps)
    count = sum(b - a + 1 for a, b in gaps)
    if size is None:
        nodes = -(-(used[-1] + 1) // gpn)
        where = (f", so the job would take {used[-1] + 1} GPUs ({nodes} node{'s' if nodes > 1 else ''} of "
                 f"cluster.gpus_per_node={gpn}) for {len(used)} in use; set cluster.nodes to check GPU ranks "
                 f"against the cluster's size")
    else:
        where = f" (the cluster has {cluster})"
    for r in own:
        if above := sorted(g for g in r.ranks if g > first and (size is None or g < size)):
            problems.append(
                f"roles.{r.name}.device_mapping: GPU rank{'s' if len(above) > 1 else ''} "
                f"{_ranges([(g, g) for g in above], 8)} leave{'' if len(above) > 1 else 's'} GPU rank"
                f"{'s' if count > 1 else ''} {skipped} ({count} GPU{'s' if count > 1 else ''}) in no role's "
                f"device_mapping: GPU ranks number the job's GPUs from 0 without gaps{where}")
    return problems


def _ranges(spans: list[tuple[int, int]], limit: int = 4) -> str:
    """Spans of ranks as '2..999, 1003' (the first ``limit``, then '...'); single ranks merge into runs."""
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a == merged[-1][1] + 1:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    text = [str(a) if a == b else f"{a}..{b}" for a, b in merged[:limit]]
    return ", ".join(text) + (", ..." if len(merged) > limit else "")


def _build(gpu: list[_GpuRole], cpu: list[_CpuRole], gpn: int, num_nodes: int, num_gpus: int, cpus: int) -> Placement:
    on_gpu: dict[int, list[tuple[str, int]]] = {g: [] for g in range(num_gpus)}
    for r in gpu:
        for w in range(r.world):
            for g in r.ranks[w * r.ngpw : (w + 1) * r.ngpw]:
                on_gpu[g].append((r.name, w))

    # CPU processes (workers, then the controller) go to the node with the fewest so far, so
    # their memory spreads across nodes; the controller counts against node 0 from the start.
    cpu_load = [(1 if n == 0 else 0, n) for n in range(num_nodes)]  # a heap of (load, node)
    heapq.heapify(cpu_load)
    cpu_nodes: dict[str, list[int]] = {}
    for c in cpu:
        for _ in range(c.world):
            load, node = heapq.heappop(cpu_load)
            heapq.heappush(cpu_load, (load + 1, node))
            cpu_nodes.setdefault(c.name, []).append(node)

    local_next = [0] * num_nodes
    procs: list[ProcessSlot] = []
    for g in range(num_gpus):
        node = g // gpn
        procs.append(ProcessSlot(g, ProcessKind.GPU, node, local_next[node], g, g % gpn, tuple(on_gpu[g])))
        local_next[node] += 1
    cpu_worker_ranks: dict[str, list[int]] = {}
    for c in cpu:
        for w, node in enumerate(cpu_nodes.get(c.name, [])):
            rank = len(procs)
            procs.append(ProcessSlot(rank, ProcessKind.CPU, node, local_next[node], None, None, ((c.name, w),)))
            local_next[node] += 1
            cpu_worker_ranks.setdefault(c.name, []).append(rank)
    procs.append(ProcessSlot(len(procs), ProcessKind.CONTROLLER, 0, local_next[0], None, None, ()))
    local_next[0] += 1

    sets = _colocated_sets(gpu)
    share = {name: tuple(n for s in sets if name in s for n in s if n != name) for s in sets for name in s}
    roles: dict[str, RolePlacement] = {}
    for r in gpu:
        workers = tuple(tuple(r.ranks[w * r.ngpw : (w + 1) * r.ngpw]) for w in range(r.world))
        roles[r.name] = RolePlacement(
            name=r.name, backend=r.backend, gpu_ranks=tuple(r.ranks), num_gpus_per_worker=r.ngpw,
            world_size=r.world, workers=workers, nodes=tuple(w[0] // gpn for w in workers),
            mesh=_mesh(r.backend), colocated_with=share.get(r.name, ()), offload=r.offload,
            engine_args=r.engine_args,
        )
    for c in cpu:
        ranks = cpu_worker_ranks.get(c.name, [])
        roles[c.name] = RolePlacement(
            name=c.name, backend=None, gpu_ranks=(), num_gpus_per_worker=0, world_size=c.world,
            workers=tuple((x,) for x in ranks), nodes=tuple(cpu_nodes.get(c.name, [])), mesh=(),
            colocated_with=(), offload=c.offload, engine_args=c.engine_args,
        )
    gres = min(gpn, num_gpus)  # GPU ranks fill nodes from node 0, so no node has more
    slurm = SlurmRequest(nodes=num_nodes, ntasks_per_node=max(local_next), gpus_per_node=gres, cpus_per_task=cpus)
    return Placement(
        gpus_per_node=gpn, num_nodes=num_nodes, num_gpus=num_gpus, roles=roles,
        processes=tuple(procs), colocated_sets=tuple(sets), slurm=slurm,
    )
