"""What one rank achieves: FLOP/s, bandwidth and per-op slowdown when its node's ranks work at once
(``rates``), the link of a tensor-parallel group (``tp_link``), and a CPU profile's attention cost
per sequence (``cpu_attention_ops``). Below the engines' cost models and the phase times that use them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlbatch.config.hardware import Hardware
from rlbatch.models.shape import ModelShape
from rlbatch.plan import comm
from rlbatch.plan.layout import Layout, RoleLayout

CPU_ATTN_OPS = 0.15
"""On a CPU profile, scaled_dot_product_attention costs about 0.6-0.9 us per (sequence, head)
per layer and model call however short the sequences (one small problem each; 2 us with its
backward), which a tiny model's token count does not show: measured on the cpu profile's VM
for 256-1024 sequences of 1-7 query tokens, 4 heads (0.55-0.9 us with 1). A GPU runs those
problems in parallel."""


@dataclass(frozen=True)
class Rates:
    """What one rank achieves while ``active`` ranks of its node work at once."""

    flops: float
    bw: float
    slow: float
    """Multiplier on per-op overhead: >1 when more Python threads than cores."""


def rates(hw: Hardware, layout: Layout, active: int, working_set: float = math.inf) -> Rates:
    """Achieved FLOP/s and bandwidth of one rank. On CPU profiles the node's cores are shared, and
    its memory bandwidth too unless the ``active`` ranks' working sets fit in the last-level cache."""
    if not hw.is_cpu:
        return Rates(hw.peak_flops * hw.mfu, hw.hbm_bw * hw.mbu, 1.0)
    threads = max(1, layout.cpus_per_task)
    cores = max(1, hw.cores_per_node)
    share = min(float(threads), cores / max(1, active))
    # In cache, each rank streams at its cores' share of the per-thread cache bandwidth; beyond it the
    # ranks split the node's memory bus (measured on the cpu profile's VM, 35.8 MiB L3: two
    # processes copying 4-8 MiB each keep 90 % of one process's rate, 256 MiB copies halve it).
    # The fraction of the working set that fits streams at the rank's own rate, the rest at its share.
    cached = min(1.0, hw.llc_bytes / max(1e-9, max(1, active) * working_set))
    in_cache = (hw.cache_bw or hw.hbm_bw) * share
    shared = min(hw.hbm_bw * share, hw.host_mem_bw / max(1, active))
    bw = 1.0 / (cached / in_cache + (1.0 - cached) / shared)
    return Rates(hw.peak_flops * hw.mfu * share, bw * hw.mbu, max(1.0, active / cores))


def tp_link(layout: Layout, r: RoleLayout, hw: Hardware) -> comm.Link:
    assert r.backend is not None
    return comm.link(hw, layout.group_spans_nodes(r.name, 1, r.backend.t))


def cpu_attention_ops(shape: ModelShape, pp: int) -> float:
    """Op-equivalents of one sequence's attention through one model call on a CPU profile."""
    return CPU_ATTN_OPS * shape.heads * math.ceil(shape.layers / pp)
