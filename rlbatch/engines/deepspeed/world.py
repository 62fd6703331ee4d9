"""DeepSpeed on the role's ranks only: its world is the role's process group while it runs.

DeepSpeed sends every collective through ``deepspeed.comm``, whose backend object (``cdb``)
wraps torch.distributed. Several of its calls use the default (global) group: ZeRO-3's
set-up barriers (``stage3.py``), its list checks that broadcast from rank 0 (``zero/utils.py``),
the rank-0 logging. On a role that does not span the whole job those collectives wait for ranks
that never join (a hang), or name a global rank that is not in the role.

``role_world(group)`` puts a ``RoleBackend`` in place of ``cdb`` for the duration of a block:
a collective without a group runs on the role's group, a source or destination rank given
without a group is read as a rank of the role (and translated to its global rank), and
``get_rank()`` / ``get_world_size()`` answer for the role. Collectives on an explicit group
(the data-parallel group from the ``mpu``) pass through unchanged. The engine enters the block
around everything that reaches DeepSpeed (initialisation, forward, backward, step, gathers),
so two DeepSpeed engines on different role groups in one process each see their own world.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch.distributed as dist

_RANKED = {"src", "dst"}

UNUSED_IMPORTS = ("mlflow",)
"""What ``import deepspeed`` would import for a part rlbatch never runs: its autotuner imports MLflow
when it is installed (about 1.1 CPU-s on every rank that builds the engine; tools/bench/launch.py)."""


def import_deepspeed() -> ModuleType:
    """``import deepspeed``, the first time without ``UNUSED_IMPORTS`` (DeepSpeed guards each with a
    try/except and goes on without it); a package this process imported already stays as it is, and
    every one of them imports normally afterwards. Then DeepSpeed's shared-memory all-reduce op is
    marked unavailable, so that it is not JIT-compiled (``rlbatch.engines.deepspeed.engine``)."""
    if "deepspeed" not in sys.modules:
        hidden = [name for name in UNUSED_IMPORTS if name not in sys.modules]
        for name in hidden:
            sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
        try:
            import deepspeed  # noqa: F401
        finally:
            for name in hidden:
                if sys.modules.get(name, 0) is None:
                    del sys.modules[name]
    module = sys.modules["deepspeed"]
    module.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return module


class RoleBackend:
    """``deepspeed.comm``'s backend, with the role's group standing in for the world."""

    def __init__(self, inner: Any, group: Any) -> None:
        self.inner = inner
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)

    def __getattr__(self, name: str) -> Any:  # everything not re-routed below
        return getattr(self.inner, name)

    def _world(self, group: Any) -> bool:
        return group is None or group is dist.group.WORLD

    def _route(self, name: str, kwargs: dict[str, Any]) -> Any:
        if self._world(kwargs.get("group")):
            kwargs["group"] = self.group
            for key in _RANKED & kwargs.keys():
                if kwargs[key] is not None:
                    kwargs[key] = self.ranks[kwargs[key]]
        return getattr(self.inner, name)(**kwargs)

    # Collectives deepspeed.comm calls with keyword arguments.
    def broadcast(self, **kw: Any) -> Any:
        return self._route("broadcast", kw)

    def broadcast_object_list(self, **kw: Any) -> Any:
        return self._route("broadcast_object_list", kw)

    def all_gather(self, **kw: Any) -> Any:
        return self._route("all_gather", kw)

    def all_gather_object(self, **kw: Any) -> Any:
        return self._route("all_gather_object", kw)

    def reduce_scatter_tensor(self, **kw: Any) -> Any:
        return self._route("reduce_scatter_tensor", kw)

    def all_gather_into_tensor(self, **kw: Any) -> Any:
        return self._route("all_gather_into_tensor", kw)

    def all_to_all_single(self, **kw: Any) -> Any:
        return self._route("all_to_all_single", kw)

    def gather(self, **kw: Any) -> Any:
        return self._route("gather", kw)

    def scatter(self, **kw: Any) -> Any:
        return self._route("scatter", kw)

    def reduce(self, **kw: Any) -> Any:
        return self._route("reduce", kw)

    def reduce_scatter(self, **kw: Any) -> Any:
        return self._route("reduce_scatter", kw)

    def send(self, **kw: Any) -> Any:
        return self._route("send", kw)

    def recv(self, **kw: Any) -> Any:
        return self._route("recv", kw)

    def isend(self, **kw: Any) -> Any:
        return self._route("isend", kw)

    def irecv(self, **kw: Any) -> Any:
        return self._route("irecv", kw)

    def barrier(self, group: Any = None, **kw: Any) -> Any:
        return self.inner.barrier(group=self.group if self._world(group) else group, **kw)

    def monitored_barrier(self, group: Any = None, **kw: Any) -> Any:
        return self.inner.monitored_barrier(group=self.group if self._world(group) else group, **kw)

    # Collectives and queries deepspeed.comm calls with positional arguments.
    def all_to_all(self, output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:
        return self.inner.all_to_all(output, input, group=self.group if self._world(group) else group,
                                     async_op=async_op)

    def all_reduce(self, tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        return self.inner.all_reduce(tensor, op, self.group if self._world(group) else group, async_op)

    def all_reduce_coalesced(self, tensors: Any, op: Any = dist.ReduceOp.SUM, group: Any = None,
                             async_op: bool = False) -> Any:
        return self.inner.all_reduce_coalesced(tensors, op, self.group if self._world(group) else group, async_op)

    def inference_all_reduce(self, tensor: Any, op: Any, group: Any = None) -> Any:
        return self.inner.all_reduce(tensor, op, self.group if self._world(group) else group, False)

    def all_gather_coalesced(self, output_tensors: Any, input_tensors: Any, group: Any = None,
                             async_op: bool = False) -> Any:
        return self.inner.all_gather_coalesced(output_tensors, input_tensors,
                                               group=self.group if self._world(group) else group, async_op=async_op)

    def get_world_group(self) -> Any:
        # The symbolic world, not the role's group object: DeepSpeed compares a group with the world
        # group to decide whether a source rank is a world rank (0) or a global rank of that group.
        return dist.group.WORLD

    def get_rank(self, group: Any = None) -> int:
        return int(dist.get_rank(self.group if self._world(group) else group))

    def get_world_size(self, group: Any = None) -> int:
        return int(dist.get_world_size(self.group if self._world(group) else group))

    def get_global_rank(self, group: Any, group_rank: int) -> int:
        return int(dist.get_global_rank(self.group if self._world(group) else group, group_rank))

    def new_group(self, ranks: Any) -> Any:
        raise RuntimeError(f"DeepSpeed asked for a new process group over ranks {list(ranks)} of the role; rlbatch "
                           "gives it the role's groups (mpu) and creates none inside a role")


@contextmanager
def role_world(group: Any) -> Iterator[None]:
    """Inside the block, DeepSpeed's world is ``group`` (see the module docstring)."""
    comm = import_deepspeed().comm
    inner = comm.comm.cdb
    if inner is None:
        comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        inner = comm.comm.cdb
    if isinstance(inner, RoleBackend):  # re-entered (a gather inside a step): keep the outer world
        inner = inner.inner
    previous = comm.comm.cdb
    comm.comm.cdb = RoleBackend(inner, group)
    try:
        yield
    finally:
        comm.comm.cdb = previous
