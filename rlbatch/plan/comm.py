"""Alpha-beta costs of collectives: ``hops * alpha + traffic / bandwidth``.

Ring algorithms (Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication
Operations in MPICH"; the same bus-bandwidth factors nccl-tests reports in its PERFORMANCE.md):
each of n ranks sends 2(n-1)/n of the buffer for an all-reduce and (n-1)/n of it for an
all-gather or a reduce-scatter; a pipelined broadcast sends the buffer once. A group that spans
nodes runs at the inter-node bandwidth of one GPU's NIC; inside a node at its NVLink bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.config.hardware import Hardware


@dataclass(frozen=True)
class Link:
    """Bandwidth (bytes/s, one direction, already derated by link_eff) and per-hop latency."""

    bw: float
    alpha: float


def link(hw: Hardware, spans_nodes: bool) -> Link:
    """The link a group runs at: the slowest hop of its ring."""
    if spans_nodes:
        return Link(hw.inter_bw * hw.link_eff, hw.inter_alpha_s)
    return Link(hw.intra_bw * hw.link_eff, hw.intra_alpha_s)


def all_reduce(size: float, n: int, ln: Link) -> float:
    """Ring all-reduce of ``size`` bytes over ``n`` ranks: 2(n-1) hops, 2(n-1)/n * S / B."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * ln.alpha + 2 * (n - 1) / n * size / ln.bw


def all_gather(size: float, n: int, ln: Link) -> float:
    """Ring all-gather whose output is ``size`` bytes: (n-1) hops, (n-1)/n * S / B."""
    if n <= 1:
        return 0.0
    return (n - 1) * ln.alpha + (n - 1) / n * size / ln.bw


def reduce_scatter(size: float, n: int, ln: Link) -> float:
    """Ring reduce-scatter whose input is ``size`` bytes: the all-gather's cost."""
    return all_gather(size, n, ln)


def all_to_all(size: float, n: int, ln: Link) -> float:
    """All-to-all where each rank holds ``size`` bytes and keeps 1/n of it."""
    return all_gather(size, n, ln)


def broadcast(size: float, n: int, ln: Link) -> float:
    """Pipelined (chunked ring) broadcast: one latency per hop plus S / B."""
    if n <= 1:
        return 0.0
    return (n - 1) * ln.alpha + size / ln.bw
