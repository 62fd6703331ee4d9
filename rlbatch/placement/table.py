"""Render a Placement for people: the table ``dry_run=true`` prints."""

from __future__ import annotations

from rlbatch.placement.placement import Placement


def compress(ranks: tuple[int, ...] | list[int]) -> str:
    """'0-7,16-23' for a list of ranks (in the given order; runs of +1 collapse)."""
    if not ranks:
        return "-"
    out, start, prev = [], ranks[0], ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def placement_table(p: Placement) -> str:
    head = ("role", "engine", "dims", "GPU ranks", "nodes", "workers", "GPUs/worker", "colocated with")
    rows = [head]
    for r in p.roles.values():
        dims = str(r.backend).split(":", 1)[1] if r.backend else "-"
        nodes = compress(sorted(set(r.nodes)))
        rows.append((
            r.name, r.engine, dims, compress(r.gpu_ranks), nodes, str(r.world_size),
            str(r.num_gpus_per_worker) if r.is_gpu else "-", ", ".join(r.colocated_with) or "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    s = p.slurm
    summary = (
        f"rlbatch placement: {p.num_gpus} GPU ranks on {p.num_nodes} node(s) "
        f"({p.gpus_per_node} GPUs per node), {p.world_size} processes "
        f"(controller = world rank {p.controller_rank} on node 0)"
    )
    request = (
        f"Slurm request: --nodes={s.nodes} --ntasks-per-node={s.ntasks_per_node} "
        f"--gres=gpu:{s.gpus_per_node} --cpus-per-task={s.cpus_per_task}"
        f"  ({s.ntasks} tasks, {s.ntasks - p.world_size} spare)"
    )
    return "\n".join([summary, "", *lines, "", request])
