"""The placement as the planner needs it: which roles share which GPUs, and which groups cross nodes.

A ``Layout`` is built from a validated ``Placement`` (``from_placement``) or directly by the
search, which tries thousands of candidates and validates only the ones it prints. Rank sets are
kept as ``range`` when contiguous, so a 1024-GPU layout costs a few comparisons, not 1024 set
insertions per role.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlbatch.engines.registry import engine_args
from rlbatch.placement import BackendSpec, Placement

A = TypeVar("A")


@dataclass(frozen=True)
class RoleLayout:
    """One enabled role. ``backend`` is None for CPU roles (reward rules, sandboxes)."""

    name: str
    backend: BackendSpec | None
    ranks: Sequence[int]
    """GPU ranks in device_mapping order (empty for CPU roles)."""
    offload: bool = True
    engine_args: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    """Workers: engine instances for inference roles, ranks for training roles, processes for CPU roles."""

    @functools.cached_property
    def args(self) -> Any:
        """The role's typed engine_args (its engine's args dataclass, defaults filled in; None for a
        CPU role or an engine that is not registered): what an engine's cost model reads."""
        return engine_args(self.engine, self.engine_args) if self.backend is not None else None

    def args_as(self, kind: type[A]) -> A:
        """``args`` as the args class of the engine a cost model models (its own)."""
        args = self.args
        assert isinstance(args, kind), (self.name, type(args).__name__, kind.__name__)
        return args

    @property
    def is_gpu(self) -> bool:
        return self.backend is not None

    @property
    def engine(self) -> str:
        return self.backend.engine if self.backend else "cpu"


def _as_range(ranks: Sequence[int]) -> Sequence[int]:
    """A contiguous ascending rank list as a range (cheap membership and node arithmetic)."""
    if ranks and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return range(ranks[0], ranks[0] + len(ranks))
    return tuple(ranks)


@dataclass(frozen=True)
class Layout:
    """Every role's ranks, and the cluster shape they live on."""

    roles: dict[str, RoleLayout]
    gpus_per_node: int
    num_gpus: int
    cpus_per_task: int = 1

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.num_gpus // self.gpus_per_node))

    def gpu_roles(self) -> list[RoleLayout]:
        return [r for r in self.roles.values() if r.is_gpu]

    def signatures(self) -> dict[tuple[str, ...], list[int]]:
        """GPU ranks grouped by the set of roles on them: one entry per distinct GPU kind.

        Every GPU of one signature holds the same roles, so memory and offload are computed
        once per signature, not once per GPU.
        """
        roles = self.gpu_roles()
        ranges = [r.ranks for r in roles if isinstance(r.ranks, range)]
        if len(ranges) == len(roles):
            cuts = sorted({0, self.num_gpus, *(c for rg in ranges for c in (rg.start, rg.stop))})
            out: dict[tuple[str, ...], list[int]] = {}
            for lo, hi in itertools.pairwise(cuts):
                sig = tuple(r.name for r in roles if lo in r.ranks)
                if sig and lo < hi:
                    out.setdefault(sig, []).extend(range(lo, hi))
            return out
        on: dict[int, list[str]] = {}
        for r in roles:
            for g in r.ranks:
                on.setdefault(g, []).append(r.name)
        out = {}
        for g in sorted(on):
            out.setdefault(tuple(on[g]), []).append(g)
        return out

    def colocated(self, a: str, b: str) -> bool:
        """True when roles ``a`` and ``b`` share at least one GPU."""
        ra, rb = self.roles[a].ranks, self.roles[b].ranks
        if isinstance(ra, range) and isinstance(rb, range):
            return max(ra.start, rb.start) < min(ra.stop, rb.stop)
        return bool(set(ra) & set(rb))

    def nodes_of(self, ranks: Sequence[int]) -> int:
        """How many nodes the given ranks touch."""
        if isinstance(ranks, range) and ranks.step == 1 and len(ranks):
            return (ranks[-1] // self.gpus_per_node) - (ranks[0] // self.gpus_per_node) + 1
        return len({g // self.gpus_per_node for g in ranks})

    def ranks_per_node(self, ranks: Sequence[int]) -> int:
        """Most ranks of the set on any one node (processes that share that node's cores)."""
        if isinstance(ranks, range) and ranks.step == 1:
            return min(len(ranks), self.gpus_per_node)
        count: dict[int, int] = {}
        for g in ranks:
            count[g // self.gpus_per_node] = count.get(g // self.gpus_per_node, 0) + 1
        return max(count.values(), default=0)

    def group_spans_nodes(self, role: str, stride: int, size: int) -> bool:
        """Whether the first process group of ``size`` ranks taken every ``stride`` ranks of ``role``
        (the mesh's inner dims make the stride) crosses a node boundary."""
        ranks = self.roles[role].ranks
        group = [ranks[i] for i in range(0, min(len(ranks), stride * size), stride)]
        return self.nodes_of(group) > 1


def from_placement(p: Placement, cpus_per_task: int = 1) -> Layout:
    """The planner's view of a validated Placement."""
    roles = {
        name: RoleLayout(
            name=name, backend=r.backend, ranks=_as_range(r.gpu_ranks), offload=r.offload,
            engine_args=dict(r.engine_args), world_size=r.world_size,
        )
        for name, r in p.roles.items()
    }
    return Layout(roles=roles, gpus_per_node=p.gpus_per_node, num_gpus=p.num_gpus, cpus_per_task=cpus_per_task)
