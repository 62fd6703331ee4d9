"""Rank sets of the process groups a role needs beyond its mesh axes (pure Python).

``rlbatch.runtime.world`` creates them on every rank of the job, in the same order, like every
other group (a group created by its members alone takes a name from how many groups each member
already has, which differs between ranks of different roles). Engines receive this rank's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import product
from typing import Any

Mesh = Sequence[tuple[str, int]]


def axis_groups(ranks: Sequence[int], mesh: Mesh, axes: set[str]) -> list[tuple[int, ...]]:
    """The ranks of a row-major ``mesh`` grouped by their coordinates on every axis not in ``axes``
    (each group in mesh order)."""
    names = [n for n, _ in mesh]
    buckets: dict[tuple[int, ...], list[int]] = {}
    for i, coord in enumerate(product(*(range(s) for _, s in mesh))):
        key = tuple(c for n, c in zip(names, coord, strict=True) if n not in axes)
        buckets.setdefault(key, []).append(int(ranks[i]))
    return [tuple(b) for b in buckets.values()]


def subgroups(ranks: Sequence[int], mesh: Mesh, ep: int = 1, ffn: Any = None) -> dict[str, list[tuple[int, ...]]]:
    """With pipeline stages (pp > 1): ``model_parallel``, each replica's tp x pp ranks (Megatron's
    model-parallel group), and ``pipeline_ends``, the first and last stages' ranks at each dp, cp and
    tp position (where a tied embedding's two copies live).

    With expert parallelism (``ep`` > 1, folded onto dp): ``expert``, ``ep`` consecutive dp ranks at
    each pp, cp and tp position (the placement keeps them inside a node), which split the experts
    between them, and ``expert_dp``, the ranks that hold the same experts (every ``ep``-th dp rank).
    None of these without pipeline stages or expert parallelism.

    A hybrid layout's ``ffn`` dims (``megatron:(attn:...|ffn:...)``, their p, d, e and t) lay the
    same ranks out a second time for the routed experts, as megatron-core's expert grid does
    (pipeline outermost, then expert-data, expert, expert-tensor innermost): ``expert`` (its e axis),
    ``expert_tp`` (t), ``expert_tp_ep`` (the t x e ranks tokens travel between) and ``expert_dp``
    (d: the ranks that hold the same expert shard)."""
    out: dict[str, list[tuple[int, ...]]] = {}
    if dict(mesh).get("pp", 1) > 1:
        out["model_parallel"] = axis_groups(ranks, mesh, {"pp", "tp"})
        out["pipeline_ends"] = [(g[0], g[-1]) for g in axis_groups(ranks, mesh, {"pp"})]
    if ffn is not None:
        grid = (("pp", ffn.p), ("dp", ffn.d), ("ep", ffn.e), ("tp", ffn.t))
        if ffn.p * ffn.d * ffn.e * ffn.t != len(ranks):
            raise ValueError(f"the ffn layout p*d*e*t = {ffn.p}*{ffn.d}*{ffn.e}*{ffn.t} does not cover the role's "
                             f"{len(ranks)} ranks")
        out |= {"expert": axis_groups(ranks, grid, {"ep"}), "expert_tp": axis_groups(ranks, grid, {"tp"}),
                "expert_tp_ep": axis_groups(ranks, grid, {"ep", "tp"}), "expert_dp": axis_groups(ranks, grid, {"dp"})}
        return out
    if ep > 1:
        dp = axis_groups(ranks, mesh, {"dp"})
        if len(dp[0]) % ep:
            raise ValueError(f"expert parallel e={ep} does not divide data parallel d={len(dp[0])}")
        out["expert"] = [g[i : i + ep] for g in dp for i in range(0, len(g), ep)]
        out["expert_dp"] = [g[i::ep] for g in dp for i in range(ep)]
    return out


def create(ranks: Sequence[int], mesh: Mesh, me: int, new_group: Callable[[list[int]], Any],
           ep: int = 1, ffn: Any = None) -> dict[str, Any]:
    """``new_group`` for every set of ``subgroups`` (collective: every rank of the job calls this
    for every role, in the same order); this rank's group of each kind."""
    mine: dict[str, Any] = {}
    for kind, sets in subgroups(ranks, mesh, ep, ffn).items():
        for s in sets:
            group = new_group(list(s))
            if me in s:
                mine[kind] = group
    return mine
