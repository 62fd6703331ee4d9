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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

DeepSpeedBackend = Any  # untyped library
"""``deepspeed.comm``'s backend object (``cdb``, a ``TorchBackend``), which ``RoleBackend`` wraps."""

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


KEYWORD_COLLECTIVES = ("broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
                       "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "gather", "scatter",
                       "reduce", "reduce_scatter", "send", "recv", "isend", "irecv")
"""Collectives ``deepspeed.comm`` calls on its backend with keyword arguments only: ``RoleBackend`` routes
each (``RoleBackend._route``)."""


class RoleBackend:
    """``deepspeed.comm``'s backend, with the role's group standing in for the world. Each of
    ``KEYWORD_COLLECTIVES`` is a method of it (set below the class) that ``_route``s its keyword
    arguments; the positional calls are written out; anything else is the inner backend's."""

    def __init__(self, inner: DeepSpeedBackend, group: ProcessGroup) -> None:
        self.inner = inner
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)

    def __getattr__(self, name: str) -> object:  # everything not re-routed here
        return getattr(self.inner, name)

    @staticmethod
    def _world(group: object) -> bool:
        return group is None or group is dist.group.WORLD

    def _group(self, group: ProcessGroup | None) -> ProcessGroup:
        """The role's group in place of the world, any other group as it is."""
        if group is None or group is dist.group.WORLD:
            return self.group
        return group

    def _route(self, name: str, kwargs: dict[str, Any]) -> object:
        """The inner backend's ``name`` on ``kwargs`` (tensors, ranks, a group, flags; as DeepSpeed passes
        them): without a group, on the role's, a ``src``/``dst`` rank read as a rank of the role."""
        if self._world(kwargs.get("group")):
            kwargs["group"] = self.group
            for key in _RANKED & kwargs.keys():
                if kwargs[key] is not None:
                    kwargs[key] = self.ranks[kwargs[key]]
        return getattr(self.inner, name)(**kwargs)

    def barrier(self, group: ProcessGroup | None = None, **kw: object) -> object:
        return self.inner.barrier(group=self._group(group), **kw)

    def monitored_barrier(self, group: ProcessGroup | None = None, **kw: object) -> object:
        return self.inner.monitored_barrier(group=self._group(group), **kw)

    # Collectives and queries deepspeed.comm calls with positional arguments. ``op``: DeepSpeed's
    # ReduceOp or torch's, which the inner backend converts.
    def all_to_all(self, output: list[torch.Tensor], input: list[torch.Tensor], group: ProcessGroup | None = None,
                   async_op: bool = False) -> object:
        return self.inner.all_to_all(output, input, group=self._group(group), async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: object = dist.ReduceOp.SUM, group: ProcessGroup | None = None,
                   async_op: bool = False) -> object:
        return self.inner.all_reduce(tensor, op, self._group(group), async_op)

    def all_reduce_coalesced(self, tensors: list[torch.Tensor], op: object = dist.ReduceOp.SUM,
                             group: ProcessGroup | None = None, async_op: bool = False) -> object:
        return self.inner.all_reduce_coalesced(tensors, op, self._group(group), async_op)

    def inference_all_reduce(self, tensor: torch.Tensor, op: object, group: ProcessGroup | None = None) -> object:
        return self.inner.all_reduce(tensor, op, self._group(group), False)

    def all_gather_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                             group: ProcessGroup | None = None, async_op: bool = False) -> object:
        return self.inner.all_gather_coalesced(output_tensors, input_tensors, group=self._group(group),
                                               async_op=async_op)

    def get_world_group(self) -> ProcessGroup | None:
        # The symbolic world, not the role's group object: DeepSpeed compares a group with the world
        # group to decide whether a source rank is a world rank (0) or a global rank of that group.
        return dist.group.WORLD

    def get_rank(self, group: ProcessGroup | None = None) -> int:
        return int(dist.get_rank(self._group(group)))

    def get_world_size(self, group: ProcessGroup | None = None) -> int:
        return int(dist.get_world_size(self._group(group)))

    def get_global_rank(self, group: ProcessGroup | None, group_rank: int) -> int:
        return int(dist.get_global_rank(self._group(group), group_rank))

    def new_group(self, ranks: Iterable[int]) -> NoReturn:
        raise RuntimeError(f"DeepSpeed asked for a new process group over ranks {list(ranks)} of the role; rlbatch "
                           "gives it the role's groups (mpu) and creates none inside a role")


def _keyword_collective(name: str) -> Callable[..., object]:
    """``RoleBackend``'s method ``name``: the inner backend's, on keyword arguments routed by ``_route``."""

    def collective(self: RoleBackend, **kw: object) -> object:
        return self._route(name, kw)

    collective.__name__, collective.__qualname__ = name, f"RoleBackend.{name}"
    return collective


for _name in KEYWORD_COLLECTIVES:
    setattr(RoleBackend, _name, _keyword_collective(_name))


@contextmanager
def role_world(group: ProcessGroup) -> Iterator[None]:
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
