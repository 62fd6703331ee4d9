"""The phases of one step, and what each GPU holds during each of them.

The scheduler (rlbatch/loop/residency.py) switches residency at the start of every phase a
rank works in: it offloads every other offloadable role on that rank (all its state kinds) and the
acting roles' kinds the phase does not need (a sync leaves the trainer's gradients and optimizer
state off the device), and reloads the kinds the acting roles need; a rank with a single GPU role
never offloads.
``simulate`` replays that rule over two steps for every kind of GPU (a signature: the set of
roles on it) and keeps the second, steady-state step: which kinds are resident in each phase,
the bytes each switch moves, and the peak memory with the term that dominates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlbatch import phases
from rlbatch.plan.layout import Layout
from rlbatch.plan.memory import COPIED, RoleMemory
from rlbatch.plan.workload import Workload


@dataclass(frozen=True)
class Phase:
    """One unit of work. ``active`` maps each GPU role that works in it to the state kinds it needs."""

    name: str
    kind: str
    """Calibration groups phases by kind: generate, reward, logprobs, train, sync."""
    active: dict[str, tuple[str, ...]]
    after: tuple[str, ...] = ()
    """Phases of the same step whose outputs it needs (what an overlapping controller must wait for)."""


def planned_phases(layout: Layout, w: Workload) -> list[Phase]:
    """The phases of one step, in the controller's order, from the phase table (``rlbatch.phases``):
    each phase's working GPU roles and the state kinds they need; it comes after the phases that
    wrote the fields it reads (a collective phase, after every phase before it)."""
    roles = layout.roles
    names = phases.step_phases(kl_to_reference=w.kl, has_reference="reference" in roles,
                               critic=w.critic and "critic" in roles, reuse_batch=w.optimizer_steps > 1,
                               kl_in_reward=w.kl_in_reward, code_sandbox="code_sandbox" in roles,
                               rule_reward="reward" in roles, base_reference=w.lora_rank > 0)
    # A KL penalty in the reward is taken from the old log-probs and the reference's.
    extra_reads = {"old_logprobs": ("ref_logprobs",)} if w.kl_in_reward else {}
    out: list[Phase] = []
    writer: dict[str, str] = {}
    for name in names:
        spec = phases.PHASES[name]
        active = {r: spec.needs for r in spec.roles if r in roles and roles[r].is_gpu}
        if spec.dispatch is phases.Dispatch.COLLECTIVE:
            after = tuple(p.name for p in out)
        else:
            after = tuple(dict.fromkeys(writer[f] for f in (*spec.reads, *extra_reads.get(name, ())) if f in writer))
        out.append(Phase(name, spec.kind, active, after))
        for f in spec.writes:
            writer.setdefault(f, name)
    return out


TRANSIENT_KEY = {"generate": "generate", "reward": "logprobs", "logprobs": "logprobs", "train": "train", "sync": "sync"}


@dataclass
class GpuKind:
    """Every GPU that holds the same set of roles."""

    roles: tuple[str, ...]
    ranks: list[int]
    memory: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """phase -> role -> term -> bytes (state kinds by name, transients by term)."""
    reload_bytes: dict[str, float] = field(default_factory=dict)
    """phase -> bytes copied back to the device at its start."""
    offload_bytes: dict[str, float] = field(default_factory=dict)
    """phase -> bytes of other roles copied to host at its start."""
    reload_count: dict[str, int] = field(default_factory=dict)
    """phase -> role state kinds brought back (copied or re-allocated) at its start."""
    offload_count: dict[str, int] = field(default_factory=dict)
    host_bytes: float = 0.0
    """Pinned host buffers this GPU's offloads keep (they persist across steps)."""
    startup_host: float = 0.0
    """Host bytes at the peak of start-up, beyond the process itself (see ``startup_host``)."""

    def phase_total(self, phase: str) -> float:
        return sum(sum(t.values()) for t in self.memory.get(phase, {}).values())

    def peak(self) -> tuple[str, float]:
        """(phase, bytes) of the fullest phase."""
        return max(((p, self.phase_total(p)) for p in self.memory), key=lambda x: x[1], default=("-", 0.0))

    def dominant(self, phase: str) -> tuple[str, str, float]:
        """(role, term, bytes) of the largest single term in ``phase``."""
        terms = [(r, k, v) for r, ts in self.memory.get(phase, {}).items() for k, v in ts.items()]
        return max(terms, key=lambda x: x[2], default=("-", "-", 0.0))


def startup_host(sig: tuple[str, ...], layout: Layout, mems: dict[str, RoleMemory], host_is_device: bool) -> float:
    """Host bytes of a rank at the peak of start-up, beyond the process: its engines are built one
    after another, each needing ``RoleMemory.load`` beyond its state while it is built, and on a
    shared rank each one's weights leave the device as soon as it is built
    (``rlbatch.loop.residency``), into a host copy. Where the device is the host (a CPU
    profile) every role's weights stay in host memory either way, and while one is offloaded they
    are there twice, the copy beside the storage it frees. Bounded over any build order: all the
    roles' weights plus the largest one-role transient."""
    at_build = {r for r in sig if len(sig) > 1 and layout.roles[r].offload}
    params = {r: mems[r].state.get("params", 0.0) for r in sig}
    if host_is_device:
        return sum(params.values()) + max((max(mems[r].load, params[r] if r in at_build else 0.0) for r in sig),
                                          default=0.0)
    return sum(params[r] for r in at_build) + max((mems[r].load for r in sig), default=0.0)


def simulate(layout: Layout, mems: dict[str, RoleMemory], phases: list[Phase], host_is_device: bool = False,
             ) -> list[GpuKind]:
    """Replay two steps of switch / work on every kind of GPU; keep the second. ``host_is_device``:
    a CPU profile, where a rank's device memory is host memory."""
    kinds = []
    for sig, ranks in layout.signatures().items():
        g = GpuKind(sig, ranks)
        resident = {r: set(mems[r].state) for r in sig}
        offloadable = {r for r in sig if len(sig) > 1 and layout.roles[r].offload}
        offloaded: set[str] = set()
        for step in range(2):
            for ph in phases:
                here = [r for r in ph.active if r in sig]
                out_b = in_b = 0.0
                out_n = in_n = 0
                if here:  # the rank works in this phase: the switch runs
                    for r in offloadable:
                        leaving = resident[r] - set(ph.active[r]) if r in here else resident[r]
                        out_b += sum(mems[r].state[k] for k in leaving if k in COPIED)
                        out_n += len(leaving)
                        if leaving:
                            offloaded.add(r)
                        resident[r] -= leaving
                    for r in here:
                        missing = (set(ph.active[r]) & set(mems[r].state)) - resident[r]
                        in_b += sum(mems[r].state[k] for k in missing if k in COPIED)
                        in_n += len(missing)
                        resident[r] |= missing
                if step == 1:
                    g.offload_bytes[ph.name], g.offload_count[ph.name] = out_b, out_n
                    g.reload_bytes[ph.name], g.reload_count[ph.name] = in_b, in_n
                    mem: dict[str, dict[str, float]] = {}
                    for r in sig:
                        terms = {k: mems[r].state[k] for k in resident[r]}
                        if r in here:
                            terms |= mems[r].transient.get(TRANSIENT_KEY[ph.kind], {})
                        if terms:
                            mem[r] = terms
                    g.memory[ph.name] = mem
        g.host_bytes = sum(mems[r].state.get(k, 0.0) for r in offloaded for k in COPIED)
        g.startup_host = startup_host(sig, layout, mems, host_is_device)
        kinds.append(g)
    return kinds
