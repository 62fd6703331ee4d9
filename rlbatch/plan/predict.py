"""``predict(...) -> Prediction``: memory per GPU and phase, time per phase, the step, the verdict.

Pure arithmetic on a Layout, a ModelShape, a Workload and a Hardware profile: no torch, no I/O,
milliseconds even for thousands of GPUs (GPUs holding the same roles are computed once).

Step time is the critical path through the step's phases. rlbatch's controller runs its loop one
phase at a time, except that the reward is scored beside the log-prob phases that follow it
(they do not need it) when it runs on ranks of its own; so by default a phase starts when the
previous one ends, the reward's end counting only for the phases that need it or share its GPUs. With
``overlap=True`` a phase starts as soon as the phases whose outputs it needs have finished and
the previous phase on any of its GPUs has released them: what a controller that dispatches
independent phases together would reach (on a disaggregated placement the reference's
log-probs run beside the CPU reward; a colocated placement is still the sum).

Asynchronous training (``Workload.max_staleness > 0``) on a placement where actor_infer's GPUs
hold no other role: generation (of a later step) runs beside every other phase of the step, and
the weight sync waits for it, so the step is max(generation, the rest) + sync. A reference on
actor_infer's GPUs (each shard inside a worker) takes its log-probs right after the generation,
there: the step is max(generation + reference, the rest) + sync. On other shared GPUs the run is
synchronous, and so is the prediction (with a note). With partial rollouts (``Workload.partial_rollouts``)
the generation is that of a batch without its longest samples (``rlbatch.plan.inflight``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from rlbatch.config.hardware import Hardware
from rlbatch.config.schema import LoraConfig
from rlbatch.engines.registry import EngineKind, spec_of
from rlbatch.models.lora import sync_form
from rlbatch.models.shape import ModelShape
from rlbatch.phases import PHASES
from rlbatch.plan import inflight, timing
from rlbatch.plan.coefficients import Coefficients
from rlbatch.plan.costs import cost_of
from rlbatch.plan.layout import Layout, RoleLayout
from rlbatch.plan.memory import RoleMemory, compute_bytes, role_memory
from rlbatch.plan.passes import cut
from rlbatch.plan.schedule import GpuKind, Phase, planned_phases, simulate
from rlbatch.plan.workload import Workload

GiB = float(1 << 30)


@dataclass
class PhaseTime:
    """One phase of the steady-state step."""

    name: str
    kind: str
    roles: tuple[str, ...]
    features: dict[str, float]
    seconds: float
    """Work only, calibrated."""
    reload_s: float = 0.0
    """Reloading its roles' state at its start (slowest GPU kind)."""
    offload_s: float = 0.0
    """Offloading the other roles of its GPUs at its start (slowest GPU kind)."""

    @property
    def total_s(self) -> float:
        """What the controller measures as time/<phase>: the residency switch and the work."""
        return self.offload_s + self.reload_s + self.seconds
    start: float = 0.0
    end: float = 0.0


@dataclass
class Prediction:
    hardware: Hardware
    shape: ModelShape
    workload: Workload
    layout: Layout
    dtype_bytes: int
    roles: dict[str, RoleMemory]
    gpus: list[GpuKind]
    phases: list[PhaseTime]
    transitions: dict[str, dict[str, float]]
    """'offload' / 'reload' -> features summed over the step (slowest GPU kind)."""
    offload_s: float
    reload_s: float
    step_s: float
    problems: list[str] = field(default_factory=list)
    """Why it does not fit (empty when it does)."""
    notes: list[str] = field(default_factory=list)
    host_bytes: float = 0.0
    """Host RAM the busiest node needs."""

    @property
    def fits(self) -> bool:
        return not self.problems

    def phase(self, name: str) -> PhaseTime | None:
        return next((p for p in self.phases if p.name == name), None)

    def measured_keys(self) -> dict[str, float]:
        """Predictions under the names a run's metrics.jsonl uses (time/<phase>, time/step)."""
        out = {f"time/{p.name}": p.total_s for p in self.phases}
        out |= {"time/offload": self.offload_s, "time/reload": self.reload_s, "time/step": self.step_s}
        return out

    def to_dict(self) -> dict[str, Any]:
        gpus = []
        for g in self.gpus:
            phase, peak = g.peak()
            role, term, big = g.dominant(phase)
            gpus.append({
                "roles": list(g.roles), "ranks": [g.ranks[0], g.ranks[-1]], "count": len(g.ranks),
                "peak_bytes": peak, "peak_phase": phase, "dominant": {"role": role, "term": term, "bytes": big},
                "phases": g.memory, "host_bytes": g.host_bytes,
            })
        return {
            "hardware": self.hardware.name, "model": self.shape.to_dict(), "workload": self.workload.to_dict(),
            "dtype_bytes": self.dtype_bytes, "fits": self.fits, "problems": self.problems, "notes": self.notes,
            "usable_bytes_per_gpu": self.hardware.usable_bytes, "host_bytes_per_node": self.host_bytes,
            "gpus": gpus,
            "roles": {r: {"state": m.state, "transient": m.transient, "kv_needed": m.kv_needed,
                          "concurrency": m.concurrency} for r, m in self.roles.items()},
            "phases": [{"name": p.name, "kind": p.kind, "roles": list(p.roles), "seconds": p.seconds,
                        "reload_s": p.reload_s, "offload_s": p.offload_s, "start": p.start, "end": p.end,
                        "features": p.features} for p in self.phases],
            "offload_s": self.offload_s, "reload_s": self.reload_s, "step_s": self.step_s,
        }


def _adapter_sync(infer: RoleLayout, w: Workload) -> bool:
    """A weight sync moves the adapters alone (``rlbatch.models.lora.sync_form``)."""
    loads = infer.backend is not None and spec_of(infer.backend.engine).loads_adapters
    return sync_form(LoraConfig(rank=w.lora_rank, sync=w.lora_sync), loads) == "adapter"


def _generation(infer: RoleLayout, mem: RoleMemory, shape: ModelShape, w: Workload, e: int, hw: Hardware,
                layout: Layout) -> dict[str, float]:
    """The generate phase's features: one generation, or for a multi-turn rollout one per turn
    (``Workload.turn_workloads``: each turn's prompt the context so far) and each trajectory's env
    steps on its critical path (``env``: turns x ``env_step_s``; other trajectories' turns run
    meanwhile, so it adds to the phase only as far as it is longer than their work); with the env
    role, the round trips to its workers (``env_calls``: a start and a step per turn for each of
    the rank's trajectories, sent and received on the rank)."""
    cost = cost_of(infer.engine)
    out: dict[str, float] = {}
    for wk, weight in w.turn_workloads():
        for k, v in cost.generate(infer, mem, shape, wk, e, hw, layout).items():
            out[k] = max(out.get(k, 0.0), v) if k == "fixed" else out.get(k, 0.0) + weight * v
    if w.turns > 1:
        out["env"] = max(0.0, w.turns * w.env_step_s - sum(v for k, v in out.items() if k in ("roofline", "overhead")))
        if w.env_workers and infer.backend is not None:  # the busiest rank's round trips, one after another
            out["env_calls"] = math.ceil(w.sequences / max(1, infer.backend.d)) * (w.turns + 1)
    return out


def _work(ph: Phase, layout: Layout, mems: dict[str, RoleMemory], shape: ModelShape, w: Workload, e: int,
          hw: Hardware) -> dict[str, float]:
    """Features of a phase's work on its busiest GPU; several roles add up when they share GPUs."""
    roles = layout.roles
    if ph.kind == "generate":
        return _generation(roles["actor_infer"], mems["actor_infer"], shape, w, e, hw, layout)
    if ph.kind == "sync":
        if _adapter_sync(roles["actor_infer"], w):  # the adapters alone: two tensors per adapted layer
            return timing.sync(roles["actor_train"], roles["actor_infer"], shape, e, hw, layout,
                               2 * shape.adapted_layers(w.lora_targets), shape.adapter_params(w.lora_rank, w.lora_targets))
        return timing.sync(roles["actor_train"], roles["actor_infer"], shape, e, hw, layout, mems["actor_train"].tensors)
    if ph.kind == "reward" and not ph.active:
        role = PHASES[ph.name].role
        if role == "code_sandbox":
            return timing.execute(roles.get(role), w, hw, layout.cpus_per_task)
        return timing.reward(roles.get(role), w, hw)
    if ph.name == "old_logprobs":
        w = replace(w, sequences=w.old_logprob_sequences)
    parts: list[tuple[str, dict[str, float]]] = []
    for name in ph.active:
        r, m = roles[name], mems[name]
        # what AdamW reads and writes: the trained weights (the adapters' with model.lora), grads, moments
        opt = sum(m.state.get(k, 0.0) for k in ("adapters" if "adapters" in m.state else "params", "grads", "optimizer"))
        tr = m.transient.get("train" if ph.kind == "train" else "logprobs", {})
        # What stays hot in cache: one layer's activations at a time (the saved activations of the
        # whole model stream from memory in backward either way) plus the logits.
        per_layer = tr.get("activations", 0.0) / (max(1, shape.layers) if ph.kind == "train" else 1)
        ws = per_layer + sum(v for k, v in tr.items() if k != "activations")
        parts.append((name, timing.forward_pass(r, shape, w, e, hw, layout, cut(r, w, hw, ph.kind == "train"), m.tensors,
                                                opt, ws)))
    out = dict(parts[0][1])
    for name, f in parts[1:]:
        shared = any(layout.colocated(name, other) for other, _ in parts if other != name)
        for k, v in f.items():
            out[k] = out.get(k, 0.0) + v if shared or k == "fixed" else max(out.get(k, 0.0), v)
    return out


def _workers(ph: Phase, layout: Layout) -> int:
    """Processes the controller commands and waits for in this phase."""
    if not ph.active:
        role = PHASES[ph.name].role
        return layout.roles[role].world_size if role in layout.roles else 1
    return len({k for r in ph.active for k in layout.roles[r].ranks})


def _concurrent(layout: Layout, g: GpuKind) -> int:
    return layout.ranks_per_node(g.ranks)


def _transitions(layout: Layout, gpus: list[GpuKind], mems: dict[str, RoleMemory], hw: Hardware,
                 coef: Coefficients, phases: list[Phase]) -> tuple[dict[str, dict[str, float]], dict[str, tuple[float, float]]]:
    """Per phase (reload, offload) seconds at its start on the slowest GPU kind, and the step's
    summed features per direction (what time/offload and time/reload measure)."""
    per_phase = {ph.name: (0.0, 0.0) for ph in phases}
    totals: dict[str, dict[str, float]] = {"offload": {}, "reload": {}}
    worst = {"offload": -1.0, "reload": -1.0}
    for g in gpus:
        tensors = max((mems[r].tensors for r in g.roles), default=0)
        conc = _concurrent(layout, g)
        sums: dict[str, dict[str, float]] = {"offload": {}, "reload": {}}
        for ph in phases:
            rel = timing.transition(g.reload_bytes.get(ph.name, 0.0), g.reload_count.get(ph.name, 0), tensors, hw, layout, conc)
            off = timing.transition(g.offload_bytes.get(ph.name, 0.0), g.offload_count.get(ph.name, 0), tensors, hw, layout, conc)
            r0, o0 = per_phase[ph.name]
            per_phase[ph.name] = (max(r0, coef.seconds("reload", rel)), max(o0, coef.seconds("offload", off)))
            for d, f in (("reload", rel), ("offload", off)):
                for k, v in f.items():
                    sums[d][k] = sums[d].get(k, 0.0) + v
        for d in ("offload", "reload"):
            s = coef.seconds(d, sums[d])
            if s > worst[d]:
                worst[d], totals[d] = s, sums[d]
    return totals, per_phase


def _reference_rides(layout: Layout) -> bool:
    """The reference's GPUs are actor_infer's and each of its shards fits inside an inference
    worker: asynchronously, its log-probs are taken there right after each generation
    (``rlbatch.loop.ahead.rider_for``, which checks the exact rank groups)."""
    ref, infer = layout.roles.get("reference"), layout.roles.get("actor_infer")
    if ref is None or infer is None or ref.backend is None or infer.backend is None or set(ref.ranks) != set(infer.ranks):
        return False
    shard, worker = len(ref.ranks) // ref.backend.d, len(infer.ranks) // max(1, infer.world_size)
    return worker % shard == 0


def _infer_alone(layout: Layout, beside: tuple[str, ...] = ()) -> bool:
    """actor_infer's GPUs hold no other GPU role but those in ``beside`` (asynchronous generation
    can run beside the rest)."""
    infer = layout.roles.get("actor_infer")
    if infer is None or not infer.is_gpu:
        return False
    return not any(layout.colocated("actor_infer", r) for r, rl in layout.roles.items()
                   if r != "actor_infer" and r not in beside and rl.is_gpu)


def _conflict(a: Phase, b: Phase, layout: Layout) -> bool:
    if not a.active or not b.active:
        return a.name == b.name
    return any(x == y or layout.colocated(x, y) for x in a.active for y in b.active)


def rank_host_bytes(p: Prediction, g: GpuKind) -> dict[str, float]:
    """Host memory of one rank of ``g`` by phase, and at the peak of its start-up ('startup'): the
    process itself, the host copies its offloads keep (pinned on a GPU) and, on a CPU profile, where
    the device is the host, everything the device holds in the phase."""
    base = p.hardware.process_host_bytes
    out = {"startup": base + g.startup_host}
    for phase in g.memory:
        out[phase] = base + g.host_bytes + (g.phase_total(phase) if p.hardware.is_cpu else 0.0)
    return out


def _memory_problems(p: Prediction, mem_limit: float | None) -> None:
    hw, layout = p.hardware, p.layout
    node_sum: dict[str, float] = {}
    for g in p.gpus:
        phase, peak = g.peak()
        role, term, big = g.dominant(phase)
        where = f"GPU ranks {g.ranks[0]}-{g.ranks[-1]}" if len(g.ranks) > 1 else f"GPU rank {g.ranks[0]}"
        if not hw.is_cpu and peak > hw.usable_bytes:
            p.problems.append(
                f"OOM on {where} ({', '.join(g.roles)}): phase {phase} needs {peak / GiB:.1f} GiB > "
                f"{hw.usable_bytes / GiB:.1f} GiB usable ({hw.hbm_bytes / GiB:.1f} GiB {hw.name} minus "
                f"{hw.reserved_bytes / GiB:.1f} GiB reserved); largest term: {role} {term} {big / GiB:.1f} GiB")
        per_node = _concurrent(layout, g)
        for ph in g.memory:  # CPU ranks share the node's RAM: sum every rank, phase by phase
            node_sum[ph] = node_sum.get(ph, 0.0) + per_node * g.phase_total(ph)
    per_node_procs = min(layout.num_gpus, layout.gpus_per_node) + 1
    steady = sum(_concurrent(layout, g) * g.host_bytes for g in p.gpus)
    if hw.is_cpu:
        steady += max(node_sum.values(), default=0.0)
    startup = sum(_concurrent(layout, g) * g.startup_host for g in p.gpus)
    host = max(steady, startup) + per_node_procs * hw.process_host_bytes
    p.host_bytes = host
    limit = hw.host_ram_bytes if mem_limit is None else min(hw.host_ram_bytes, mem_limit)
    if host > limit:
        what = "device state, offloaded state and" if hw.is_cpu else "offloaded (pinned) state and"
        p.problems.append(
            f"host RAM: the busiest node needs {host / GiB:.1f} GiB ({what} {per_node_procs} processes at "
            f"{hw.process_host_bytes / GiB:.1f} GiB) > {limit / GiB:.1f} GiB per node")
    for r, m in p.roles.items():
        if "kv_cache" in m.state and m.state["kv_cache"] <= 0 and spec_of(layout.roles[r].engine).reserves_device_share:
            p.problems.append(f"roles.{r}: {'; '.join(m.notes)}")


def predict(layout: Layout, shape: ModelShape, w: Workload, hw: Hardware, model_dtype: str = "auto",
            coef: Coefficients | None = None, mem_limit: float | None = None, overlap: bool = False) -> Prediction:
    """Everything the planner knows about one placement. ``overlap``: see the module docstring."""
    coef = coef or Coefficients()
    e = compute_bytes(model_dtype, hw)
    mems = {r.name: role_memory(r, shape, w, e, hw) for r in layout.gpu_roles()}
    phases = planned_phases(layout, w)
    gpus = simulate(layout, mems, phases, host_is_device=hw.is_cpu)
    totals, per_phase = _transitions(layout, gpus, mems, hw, coef, phases)
    rides = w.max_staleness > 0 and _reference_rides(layout)
    ahead = w.max_staleness > 0 and _infer_alone(layout, ("reference",) if rides else ())
    tailless = ahead and w.partial_rollouts  # partial rollouts: a batch without its longest samples
    times: list[PhaseTime] = []
    for ph in phases:
        f = _work(ph, layout, mems, shape, inflight.tail_free(w) if tailless and ph.kind == "generate" else w, e, hw)
        f["workers"] = timing.command(_workers(ph, layout), hw, layout)
        rel, off = per_phase[ph.name]
        work_s = coef.seconds(ph.kind, f)
        if ph.kind in ("generate", "reward"):  # dynamic sampling repeats generate + score per round
            work_s *= w.generation_rounds
        times.append(PhaseTime(ph.name, ph.kind, tuple(ph.active) or (PHASES[ph.name].role,), f, work_s, rel, off))
    dynamic = w.zero_variance_frac is not None
    riding = {"ref_logprobs"} if ahead and rides else set()
    for i, (ph, t) in enumerate(zip(phases, times, strict=True)):
        if ph.name in riding:  # right after the generation, on its GPUs
            ready = [times[j].end for j, q in enumerate(phases[:i]) if q.kind == "generate"]
        elif ahead and ph.kind != "sync":  # generation ran ahead: the step's samples are already there
            ready = [times[j].end for j, q in enumerate(phases[:i])
                     if q.kind != "generate" and q.name not in riding
                     and (q.kind != "reward" or q.name in ph.after or _conflict(q, ph, layout))]
        elif overlap:
            ready = [times[j].end for j, q in enumerate(phases[:i])
                     if q.name in ph.after or _conflict(q, ph, layout) or (dynamic and q.kind == "reward")]
        else:  # the controller's order, but a reward on other ranks scores beside the phases after it
            # (not with dynamic sampling: each round is scored before the next round or the batch goes on)
            ready = [times[j].end for j, q in enumerate(phases[:i])
                     if q.kind != "reward" or dynamic or q.name in ph.after or _conflict(q, ph, layout)]
        t.start = max(ready, default=0.0)
        t.end = t.start + t.total_s
    step = max((t.end for t in times), default=0.0) + coef.seconds("step", {"fixed": 1.0})
    pred = Prediction(hw, shape, w, layout, e, mems, gpus, times, totals,
                      coef.seconds("offload", totals["offload"]), coef.seconds("reload", totals["reload"]), step)
    pred.notes = [n for m in mems.values() for n in m.notes]
    if w.prompt_len_assumed:
        pred.notes.append(f"prompt length assumed {w.prompt_len:g} tokens (set --prompt-len)")
    if w.zero_variance_frac is not None:
        pred.notes.append(f"dynamic sampling: {w.generation_rounds:.2f} expected generate+score rounds per step, "
                          f"from a zero-variance group fraction of {w.zero_variance_frac:g} (set --zero-variance-frac)")
    if w.max_staleness > 0:
        pred.notes.append(f"max_staleness={w.max_staleness}: generation runs beside the other phases (step = "
                          f"max(generation, the rest) + sync)" + (", the reference's log-probs right after it on its "
                          "GPUs" if riding else "") + ("; partial rollouts: the generation of a batch without its "
                          "longest samples, which go on into later steps" if tailless else "") if ahead else
                          f"max_staleness={w.max_staleness}: actor_infer shares GPUs with another role, so the run "
                          f"is synchronous")
    if w.response_assumed:
        mean = w.turn_response_mean if w.turns > 1 else w.response_mean
        pred.notes.append(f"mean response assumed {mean:g} of {w.max_new_tokens} tokens"
                          f"{' a turn' if w.turns > 1 else ''} (set --response-mean)")
    if w.turns > 1:
        pred.notes.append(f"multi-turn rollout: {w.turns:g} turns of {w.turn_response_mean:g} generated tokens and "
                          f"{w.observation_len:g}-token observations per trajectory, {w.env_step_s:g} s per env step"
                          + (" (assumed: set --turns, --observation-tokens, --env-step-s)" if w.turns_assumed else ""))
    _memory_problems(pred, mem_limit)
    if any(r.backend is not None and r.backend.kind is EngineKind.INFER and r.backend.p > 1 for r in layout.gpu_roles()):
        pred.notes.append("pipeline-parallel inference assumed to keep every stage busy")
    return pred
