"""``program=selftest``: check a placement on real processes before spending GPU-hours on it.

    python -m rlbatch.launch program=selftest roles=areal_16gpu cluster=slurm wait=true

Every rank reports who it is (roles, worker index, node, local GPU, host, device, mesh
coordinates, group membership); the controller compares each report with the Placement. Then
every role group, every DeviceMesh axis and the weight-sync group run an all_reduce of
(world rank + 1), and the controller checks each sum. The result goes to
<run_dir>/selftest.json; any mismatch fails the run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import TypedDict

import torch
import torch.distributed as dist

from rlbatch.config.schema import RLBatchConfig
from rlbatch.runtime.control import Controller
from rlbatch.runtime.env import read_env
from rlbatch.runtime.faults import maybe_fault
from rlbatch.runtime.postmortem import describe_rank
from rlbatch.runtime.rundir import RunDir
from rlbatch.runtime.world import World

log = logging.getLogger(__name__)


class Report(TypedDict):
    """What a rank says about itself: its slot, its process, and its torch view of the groups."""

    world_rank: int
    kind: str
    roles: list[list[object]]
    """[role, worker index] of each role the rank serves."""
    node: int
    gpu_rank: int | None
    local_gpu: int | None
    host: str
    pid: int
    slurm_nodeid: int | None
    slurm_localid: int | None
    device: str
    torch_rank: int
    torch_world: int
    group_ranks: dict[str, int]
    """This rank's rank in each group (-1: not a member)."""
    mesh_coords: dict[str, list[int]]


def _report(world: World) -> Report:
    env = read_env()
    s = world.slot
    return {
        "world_rank": world.rank, "kind": s.kind.value, "roles": [list(x) for x in s.roles], "node": s.node,
        "gpu_rank": s.gpu_rank, "local_gpu": s.local_gpu, "host": socket.gethostname(), "pid": os.getpid(),
        "slurm_nodeid": env.slurm_nodeid, "slurm_localid": env.slurm_localid, "device": str(world.device),
        "torch_rank": dist.get_rank(), "torch_world": dist.get_world_size(),
        "group_ranks": {name: dist.get_rank(g) for name, g in world.groups.items()},
        "mesh_coords": {name: list(m.get_coordinate() or []) for name, m in world.meshes.items()},
    }


def _sums(world: World) -> dict[str, float]:
    """all_reduce(world rank + 1) over every group and mesh axis this rank belongs to."""
    out: dict[str, float] = {}
    dev = world.device
    for name, group in world.groups.items():  # same order on every rank
        if world.rank in world.members[name]:
            t = torch.tensor([float(world.rank + 1)], device=dev)
            world.check("all_reduce", name, dist.all_reduce, t, group=group)
            out[name] = t.item()
    for name, mesh in world.meshes.items():
        for axis in mesh.mesh_dim_names or ():
            t = torch.tensor([float(world.rank + 1)], device=dev)
            world.check(f"all_reduce over mesh axis {axis}", name, dist.all_reduce, t, group=mesh.get_group(axis))
            out[f"{name}/{axis}"] = t.item()
    return out


def handlers(world: World, cfg: RLBatchConfig, run: RunDir) -> dict[str, Callable[[], object]]:
    def sums() -> dict[str, float]:
        maybe_fault("selftest", world.rank)
        return _sums(world)

    return {"report": lambda: _report(world), "sums": sums}


def _expected(world: World) -> dict[int, dict[str, float]]:
    """For every rank, the sum each of its groups and mesh axes must produce."""
    p = world.placement
    exp: dict[int, dict[str, float]] = {r: {} for r in range(p.world_size)}
    for name, ranks in world.members.items():
        for r in ranks:
            exp[r][name] = float(sum(x + 1 for x in ranks))
    for name, role in p.roles.items():
        if not role.is_gpu:
            continue
        names = [n for n, _ in role.mesh]
        mesh = torch.tensor(role.gpu_ranks).reshape([s for _, s in role.mesh])
        for i, axis in enumerate(names):
            moved = mesh.movedim(i, -1).reshape(-1, mesh.shape[i])  # rows = groups along this axis
            for row in moved.tolist():
                for r in row:
                    exp[r][f"{name}/{axis}"] = float(sum(x + 1 for x in row))
    return exp


def _check_report(world: World, r: int, rep: Report) -> list[str]:
    p = world.placement
    s = p.processes[r]
    bad = []
    got: Mapping[str, object] = rep
    want: dict[str, object] = {"world_rank": r, "kind": s.kind.value, "roles": [list(x) for x in s.roles], "node": s.node,
            "gpu_rank": s.gpu_rank, "local_gpu": s.local_gpu, "torch_rank": r, "torch_world": p.world_size}
    if rep["slurm_nodeid"] is not None:
        want["slurm_nodeid"] = s.node
        want["slurm_localid"] = s.local_rank
    for k, v in want.items():
        if got[k] != v:
            bad.append(f"{describe_rank(p, r)}: {k} is {got[k]!r}, placement says {v!r}")
    for name, ranks in world.members.items():
        inside = rep["group_ranks"][name] >= 0
        if inside != (r in ranks):
            bad.append(f"{describe_rank(p, r)}: membership of group {name} is {inside}, placement says {r in ranks}")
    return bad


def controller(world: World, cfg: RLBatchConfig, run: RunDir) -> None:
    p = world.placement
    ctl = Controller(world.comm, world.timeout_s, lambda r: describe_rank(p, r))
    workers = [r for r in range(p.world_size) if r != world.rank]
    reports = ctl.call(workers, "report") | {world.rank: _report(world)}
    problems = [msg for r in sorted(reports) for msg in _check_report(world, r, reports[r])]
    sums = ctl.call(workers, "sums") | {world.rank: _sums(world)}
    expected = _expected(world)
    for r in sorted(sums):
        if sums[r] != expected[r]:
            problems.append(f"{describe_rank(p, r)}: sums {sums[r]} != expected {expected[r]}")
    ctl.shutdown(workers)
    result = {"ok": not problems, "problems": problems, "reports": reports, "sums": sums,
              "groups": {k: list(v) for k, v in world.members.items()}}
    (run.path / "selftest.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    hosts = sorted({rep["host"] for rep in reports.values()})
    checks = sum(len(v) for v in expected.values())
    if problems:
        raise RuntimeError("selftest failed:\n  " + "\n  ".join(problems))
    print(f"selftest ok: {p.world_size} processes on {len(hosts)} host(s) {hosts}, "
          f"{len(world.members)} groups, {checks} collective results checked", flush=True)
