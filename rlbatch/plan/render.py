"""Tables for people: memory per GPU and phase with the dominant term, time per phase, the verdict."""

from __future__ import annotations

from collections.abc import Sequence

from rlbatch.placement.table import compress
from rlbatch.plan.control import control_line
from rlbatch.plan.predict import Prediction
from rlbatch.plan.workload import DEFAULT_IMAGE_SIDE


def size(n: float) -> str:
    """Bytes as GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale or unit == "KiB":
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def count(n: float) -> str:
    """7.6B, 125K: parameter counts as people say them."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def secs(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def table(rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Left-aligned columns with a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _header(p: Prediction) -> str:
    s, w, hw = p.shape, p.workload, p.hardware
    moe = f", {s.experts} experts (top {s.experts_per_token})" if s.experts else ""
    return (
        f"rlbatch plan: {s.name} ({count(s.params)} params{moe}, {s.layers} layers, hidden {s.hidden}, "
        f"vocab {s.vocab}) on {p.layout.num_gpus} x {hw.name} ({p.layout.num_nodes} node(s) of "
        f"{p.layout.gpus_per_node}), {p.dtype_bytes * 8}-bit compute\n"
        f"step batch: {w.sequences} sequences x ({w.prompt_len:g} prompt + {w.response_mean:.3g} mean / "
        f"{w.response_max} max response tokens), {w.mini_batches} mini-batch(es) x {w.epochs} epoch(s), "
        f"grad_accum {w.grad_accum}"
        + _vision_line(p)
    )


def _vision_line(p: Prediction) -> str:
    """A vision-language model's images: tokens per prompt and the tower's share of the parameters."""
    s, w, tower = p.shape, p.workload, p.shape.tower
    if tower is None:
        return ""
    state = "trained" if w.train_vision else "frozen: no gradients or optimizer state"
    side = DEFAULT_IMAGE_SIDE
    image = f"; image size assumed {side}x{side}, its tokens added to the text's" if w.images_assumed else ""
    return (f"\nvision tower ({tower.arch}): {count(s.vision_params)} params, {100 * s.vision_params / s.params:.1f}% of "
            f"the model, {state}; {w.image_tokens:g} image tokens per prompt ({w.image_patches:g} patches, "
            f"{w.vision_flops / 1e9:.3g} GFLOP forward{image})")


def memory_section(p: Prediction) -> str:
    hw = p.hardware
    limit = f"usable {size(hw.usable_bytes)} of {size(hw.hbm_bytes)}" if not hw.is_cpu else \
        f"ranks share the node's {size(hw.host_ram_bytes)} RAM"
    out = [f"memory per GPU ({limit}):"]
    for g in p.gpus:
        rows = [("phase", "total", "largest terms")]
        for phase, roles in g.memory.items():
            terms = sorted(((v, f"{r}.{k}") for r, ts in roles.items() for k, v in ts.items()), reverse=True)
            rows.append((phase, size(g.phase_total(phase)), ", ".join(f"{n} {size(v)}" for v, n in terms[:3])))
        phase, peak = g.peak()
        role, term, big = g.dominant(phase)
        verdict = "fits" if hw.is_cpu or peak <= hw.usable_bytes else "DOES NOT FIT"
        out.append(f"GPU ranks {compress(g.ranks)} [{', '.join(g.roles)}]")
        out.append(table(rows))
        out.append(f"  peak: {phase} {size(peak)} (dominant: {role} {term} {size(big)}) -> {verdict}")
        if g.host_bytes:
            out.append(f"  offloaded to host per GPU: {size(g.host_bytes)}")
    out.append(f"host RAM, busiest node: {size(p.host_bytes)} of {size(hw.host_ram_bytes)}")
    return "\n".join(out)


def roles_section(p: Prediction) -> str:
    rows: list[tuple[str, ...]] = [("role", "engine", "dims", "params", "grads", "optimizer", "kv_cache", "offload")]
    for name, m in p.roles.items():
        r = p.layout.roles[name]
        dims = str(r.backend).split(":", 1)[1] if r.backend else "-"
        rows.append((name, r.engine, dims, *(size(m.state[k]) if k in m.state else "-"
                                             for k in ("params", "grads", "optimizer", "kv_cache")),
                     "yes" if r.offload else "no"))
    return "state per GPU (most loaded GPU of each role):\n" + table(rows)


def time_section(p: Prediction) -> str:
    rows = [("phase", "roles", "time", "reload", "offload", "span", "largest feature")]
    for t in p.phases:
        feats = {k: v for k, v in t.features.items() if k not in ("fixed", "transitions")}
        big = max(feats, key=lambda k: feats[k]) if feats else "-"
        rows.append((t.name, ",".join(t.roles), secs(t.seconds), secs(t.reload_s), secs(t.offload_s),
                     f"{secs(t.start)} - {secs(t.end)}", big))
    return (f"time per phase ({p.hardware.name}; reload and offload run at the start of a phase):\n" + table(rows) +
            f"\nstep: {secs(p.step_s)}   (offload {secs(p.offload_s)}, reload {secs(p.reload_s)} in total)"
            f"\n{control_line(p.layout.num_gpus, p.step_s)}")


def report(p: Prediction) -> str:
    """The whole prediction as the CLI prints it."""
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    parts = [_header(p), roles_section(p), memory_section(p), time_section(p), f"verdict: {verdict}"]
    parts += [f"  - {x}" for x in p.problems]
    if p.notes:
        parts.append("notes:\n" + "\n".join(f"  - {n}" for n in p.notes))
    return "\n\n".join(parts[:5]) + ("\n" + "\n".join(parts[5:]) if len(parts) > 5 else "")
