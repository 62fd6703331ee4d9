"""Write a Placement to the run directory and read it back on every rank.

The launcher computes the Placement once and writes ``placement.json``; ranks load it instead
of planning again, so every process sees exactly the placement that was printed and submitted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlbatch.placement.backend import BackendSpec, ParallelDims
from rlbatch.placement.placement import Placement, ProcessKind, ProcessSlot, RolePlacement, SlurmRequest

_DIMS = ("d", "t", "p", "c", "e")


def _dims(d: dict[str, Any]) -> ParallelDims:
    return ParallelDims(**{k: int(d[k]) for k in _DIMS})


def _backend(d: dict[str, Any] | None) -> BackendSpec | None:
    if d is None:
        return None
    attn = _dims(d["attn"]) if "attn" in d else None
    ffn = _dims(d["ffn"]) if "ffn" in d else None
    return BackendSpec(engine=d["engine"], dims=_dims(d), attn=attn, ffn=ffn)


def placement_from_dict(d: dict[str, Any]) -> Placement:
    """Inverse of ``Placement.to_dict()``."""
    roles = {
        name: RolePlacement(
            name=name, backend=_backend(r["backend"]), gpu_ranks=tuple(r["gpu_ranks"]),
            num_gpus_per_worker=r["num_gpus_per_worker"], world_size=r["world_size"],
            workers=tuple(tuple(w) for w in r["workers"]), nodes=tuple(r["nodes"]),
            mesh=tuple((k, int(v)) for k, v in r["mesh"].items()),
            colocated_with=tuple(r["colocated_with"]), offload=r["offload"], engine_args=dict(r["engine_args"]),
        )
        for name, r in d["roles"].items()
    }
    procs = tuple(
        ProcessSlot(
            world_rank=p["world_rank"], kind=ProcessKind(p["kind"]), node=p["node"], local_rank=p["local_rank"],
            gpu_rank=p["gpu_rank"], local_gpu=p["local_gpu"], roles=tuple((n, int(w)) for n, w in p["roles"]),
        )
        for p in d["processes"]
    )
    s = d["slurm"]
    return Placement(
        gpus_per_node=d["gpus_per_node"], num_nodes=d["num_nodes"], num_gpus=d["num_gpus"], roles=roles,
        processes=procs, colocated_sets=tuple(tuple(x) for x in d["colocated_sets"]),
        slurm=SlurmRequest(nodes=s["nodes"], ntasks_per_node=s["ntasks_per_node"],
                           gpus_per_node=s["gpus_per_node"], cpus_per_task=s["cpus_per_task"]),
    )


def save_placement(p: Placement, path: str | Path) -> None:
    Path(path).write_text(json.dumps(p.to_dict(), indent=1) + "\n")


def load_placement(path: str | Path) -> Placement:
    return placement_from_dict(json.loads(Path(path).read_text()))
