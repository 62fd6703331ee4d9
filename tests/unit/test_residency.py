"""What a shared device holds and when, decided on CPU with stand-in engines that keep count:

- start-up: an engine that reserves a share of the device (vLLM) is built first on its rank, and on
  a rank shared by several roles each engine's state leaves the device before the next is built;
- a phase leaves on a shared device only what it needs (a sync keeps the trainer's gradients and
  optimizer off the device), at no extra copy per step;
- state whose next use overwrites it (the inference weights before a sync) is discarded instead of
  kept, by an engine that can, when the loop has said a sync comes first; never at start-up, in
  asynchronous generation, or before a generation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbatch.engines import registry
from rlbatch.engines.base import EngineContext
from rlbatch.engines.offload import Transfer
from rlbatch.engines.registry import EngineKind, EngineSpec
from rlbatch.loop.residency import Residency
from rlbatch.placement import place

# -- start-up order ------------------------------------------------------------------------------

DEVICE = {"free": 100}
"""The device's free memory while the stand-in engines build (a share: 100 in all)."""
EVENTS: list[tuple[str, str]] = []


class _Built:
    """Takes ``size`` of the device when built, refusing (as vLLM does) when less is free; gives it
    back when offloaded."""

    size = 0
    state_kinds: tuple[str, ...] = ("params",)

    def __init__(self, ctx: EngineContext) -> None:
        self.role = ctx.role
        if DEVICE["free"] < self.size:
            raise RuntimeError(f"{ctx.role}: {DEVICE['free']} free on the device < {self.size} it needs at start-up")
        DEVICE["free"] -= self.size
        self.resident = True
        EVENTS.append(("build", ctx.role))

    def offload(self, kinds: Iterable[str]) -> Transfer:
        if self.resident and list(kinds):
            DEVICE["free"] += self.size
            self.resident = False
            EVENTS.append(("offload", self.role))
        return Transfer(self.size)

    def reload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()


class ShareEngine(_Built):
    """Reserves half the device at start-up, like vLLM's gpu_memory_utilization=0.5."""

    size = 50


class TrainEngine(_Built):
    size = 60


@dataclass(frozen=True)
class NoArgs:
    pass


STUBS = (EngineSpec("stubshare", EngineKind.INFER, NoArgs, f"{__name__}:ShareEngine", dims="d", reserves_device_share=True),
         EngineSpec("stubtrain", EngineKind.TRAIN, NoArgs, f"{__name__}:TrainEngine", dims="d"))


@pytest.fixture
def stub_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-ins registered for one test, then gone: other tests list the built engines."""
    for spec in STUBS:
        monkeypatch.setitem(registry.REGISTRY, spec.name, spec)


def runtime_on(rank: int, roles: dict[str, tuple[list[int], str]]) -> Any:
    """A RankRuntime for ``rank`` of a placement of ``roles`` (role -> device_mapping, backend)."""
    from rlbatch.config.compose import compose
    from rlbatch.loop.rank_runtime import RankRuntime

    placement = place({"cluster": {"gpus_per_node": 8}, "roles": {
        role: {"device_mapping": dm, "backend": backend} for role, (dm, backend) in roles.items()}})
    slot = placement.processes[rank]
    world = SimpleNamespace(placement=placement, slot=slot, roles=dict(slot.roles), device=torch.device("cpu"),
                            meshes={}, groups=dict.fromkeys(roles), subgroups={}, comm=None)
    DEVICE["free"] = 100
    EVENTS.clear()
    return RankRuntime(world, compose([]))  # type: ignore[arg-type]


@pytest.mark.usefixtures("stub_engines")
def test_the_engine_that_reserves_a_share_builds_first_and_each_leaves_the_device_before_the_next() -> None:
    """Trainer (60) then vLLM (50 of 100) would find 40 free and refuse to start; built first, and
    every engine put away once built, each build finds the device free, as the first phase does."""
    rt = runtime_on(0, {"actor_train": ([0, 1], "stubtrain:d2"), "actor_infer": ([0, 1], "stubshare:d2"),
                        "reference": ([0, 1], "stubtrain:d2")})
    assert EVENTS == [("build", "actor_infer"), ("offload", "actor_infer"), ("build", "actor_train"),
                      ("offload", "actor_train"), ("build", "reference"), ("offload", "reference")]
    assert DEVICE["free"] == 100 and set(rt.engines) == {"actor_train", "actor_infer", "reference"}
    # A role alone on its rank keeps its state: nothing to take turns with.
    runtime_on(1, {"actor_train": ([0], "stubtrain:d1"), "actor_infer": ([1], "stubshare:d1")})
    assert EVENTS == [("build", "actor_infer")]


# -- phase boundaries ----------------------------------------------------------------------------

SIZE = {"params": 4, "grads": 4, "optimizer": 8, "kv_cache": 16}


class Stash:
    """An engine whose offload keeps every kind (as ``TensorStash`` engines do): records each move."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.state_kinds, self.on = kinds, set(kinds)
        self.moves: list[tuple[str, str]] = []

    def _move(self, kinds: Iterable[str], way: str, present: bool) -> Transfer:
        moved = [k for k in kinds if (k in self.on) == present]
        self.on = self.on - set(moved) if present else self.on | set(moved)
        self.moves += [(way, k) for k in moved]
        return Transfer(sum(SIZE[k] for k in moved))

    def offload(self, kinds: Iterable[str]) -> Transfer:
        return self._move(kinds, "out", True)

    def reload(self, kinds: Iterable[str]) -> Transfer:
        return self._move(kinds, "in", False)


class Discarding(Stash):
    """An engine that can also drop state without a copy (vLLM's level-2 sleep)."""

    def discard(self, kinds: Iterable[str]) -> Transfer:
        return self._move(kinds, "discard", True)


TRAIN = ("params", "grads", "optimizer")


def colocated() -> tuple[Residency, dict[str, Stash]]:
    engines = {"actor_train": Stash(TRAIN), "actor_infer": Discarding(("params", "kv_cache")),
               "reference": Stash(("params",))}
    res = Residency(dict.fromkeys(engines, True), torch.device("cpu"))
    for role, e in engines.items():
        res.add(role, e)
        e.moves.clear()
    return res, engines


STEP = [("generate", ("actor_infer",)), ("ref_logprobs", ("reference",)), ("train", ("actor_train",)),
        ("sync", ("actor_train", "actor_infer"))]


def run(res: Residency, phases: list[tuple[str, tuple[str, ...]]], discard: dict[str, Any] | None = None) -> None:
    for name, acting in phases:
        with res.phase(name, acting, discard if name in ("ref_logprobs", "train") else None):
            pass


def test_a_sync_leaves_the_trainers_gradients_and_optimizer_off_a_shared_device_at_no_extra_copy() -> None:
    """During the sync the trainer gathers its weights and vLLM's weights are awake: its gradients
    and optimizer state leave the device first. The next generate would have moved them anyway,
    so a step still moves each kind once each way."""
    res, e = colocated()
    run(res, STEP)
    assert e["actor_train"].on == {"params"} and e["actor_infer"].on == {"params"}
    for engine in e.values():
        engine.moves.clear()
    run(res, STEP)  # a steady-state step
    assert sorted(e["actor_train"].moves) == sorted([(w, k) for w in ("in", "out") for k in TRAIN])
    assert sorted(e["actor_infer"].moves) == sorted([(w, k) for w in ("in", "out") for k in ("params", "kv_cache")])
    # A rank with one GPU role moves nothing, whatever the phase needs.
    alone = Stash(TRAIN)
    solo = Residency({"actor_train": True}, torch.device("cpu"))
    solo.add("actor_train", alone)
    run(solo, [("sync", ("actor_train", "actor_infer")), ("checkpoint", ("actor_train",))])
    assert alone.moves == []


def test_announced_state_is_discarded_by_an_engine_that_can_and_kept_by_the_others() -> None:
    res, e = colocated()
    hint = {"actor_infer": ["params"], "reference": ["params"]}
    run(res, STEP, discard=hint)
    # Entering ref_logprobs: vLLM's weights dropped (its KV cache goes with them), the reference,
    # which cannot drop, keeps its own when it leaves at train.
    assert e["actor_infer"].moves[:3] == [("in", "params"), ("in", "kv_cache"), ("discard", "params")]
    assert ("out", "kv_cache") in e["actor_infer"].moves and ("out", "params") in e["reference"].moves
    assert ("out", "params") not in e["actor_infer"].moves


# -- the controller's announcement -------------------------------------------------------------------


class Sent:
    def __init__(self) -> None:
        self.commands: list[tuple[str, dict[int, dict[str, Any]]]] = []

    def send(self, ranks: list[int], name: str, per_rank: dict[int, dict[str, Any]], label: str = "") -> Any:
        self.commands.append((per_rank[ranks[0]]["phase"], per_rank))
        return None


@pytest.fixture
def pipe() -> Any:
    from rlbatch.loop.controller import Pipeline
    from rlbatch.runtime.dataplane import Traffic

    p = object.__new__(Pipeline)
    p.ctl, p.where, p.length, p.started, p.data_traffic = Sent(), {}, {}, 0, Traffic()
    p.pending_drop, p.overwritten_next = {}, {}
    p.world = SimpleNamespace(members={"actor_infer": (0, 1), "actor_train": (0, 1), "reference": (0, 1), "reward": (2,)})
    return p


def hints(p: Any, phases: list[tuple[str, tuple[str, ...]]]) -> list[tuple[str, Any]]:
    """Start ``phases`` (``announce`` between them where named); what each rank 0 command carries."""
    p.ctl.commands.clear()
    for name, roles in phases:
        if name == "announce":
            p.announce("sync")
            continue
        ranks = p.world.members[roles[0]]
        p.start(name, roles, {r: {} for r in ranks})
    return [(name, per_rank[min(per_rank)].get("discard")) for name, per_rank in p.ctl.commands]


def test_the_inference_weights_may_be_discarded_between_the_announcement_and_the_sync(pipe: Any) -> None:
    """First step: the start-up weights are read by generate, so nothing is said before it; once
    the step's generation is done the loop announces the sync, and every phase until then may drop
    the inference weights (ranks of the reward worker hear nothing of it). The sync ends it; a
    checkpoint after it, and the next generate, keep them (generate reads them)."""
    step = [("generate", ("actor_infer",)), ("announce", ()), ("score", ("reward",)),
            ("ref_logprobs", ("reference",)), ("train", ("actor_train",)), ("sync", ("actor_train", "actor_infer"))]
    got = hints(pipe, [*step, ("checkpoint", ("actor_train",)), ("generate", ("actor_infer",))])
    assert got == [("generate", None), ("score", None), ("ref_logprobs", {"actor_infer": ["params"]}),
                   ("train", {"actor_infer": ["params"]}), ("sync", None), ("checkpoint", None), ("generate", None)]
    # Resume: the checkpoint loads, the sync loads the weights; nothing was announced, nothing dropped.
    assert hints(pipe, [("checkpoint", ("actor_train",)), ("sync", ("actor_train", "actor_infer")),
                        ("generate", ("actor_infer",))]) == [("checkpoint", None), ("sync", None), ("generate", None)]


# -- the loops' announcements ------------------------------------------------------------------------


class FakeLoop:
    """The ``Loop`` the programs drive, recording the calls that touch the inference weights."""

    events: list[str] = []

    def __init__(self, world: Any, cfg: Any, run: Any) -> None:
        self.n = 2
        FakeLoop.events = []
        self.scoring = SimpleNamespace(result=lambda: (torch.tensor([1.0, 0.0, 1.0, 0.0]), {}))
        self.critic = SimpleNamespace(
            values=lambda ro: [torch.zeros(1) for _ in range(4)],
            start_train=lambda ro, targets: SimpleNamespace(result=lambda: {}))

    def steps(self) -> Iterator[int]:
        yield from range(2)

    def generate(self, step: int) -> Any:
        self.events.append("generate")
        return SimpleNamespace(ids=[0, 1, 2, 3])

    def sync_follows(self) -> None:
        self.events.append("sync_follows")

    def log_probs(self, rollouts: Any) -> None:
        self.events.append("log_probs")

    def shaped(self, rewards: torch.Tensor, rollouts: Any) -> tuple[torch.Tensor, list[int]]:
        return rewards, [1, 1, 1, 1]

    def actions(self, rollouts: Any, lengths: list[int]) -> None:
        return None  # single-turn responses

    def train_actor(self, rollouts: Any, targets: Any) -> dict[str, float]:
        self.events.append("train")
        return {}

    def sync(self) -> None:
        self.events.append("sync")

    def end_step(self, *args: Any) -> None:
        self.events.append("|")

    def finish(self) -> None:
        pass


@pytest.mark.parametrize(("algo", "expected"), [
    ([], ["generate", "sync_follows", "log_probs", "train", "sync", "|"] * 2),
    # PPO's critic warm-up: the actor neither trains nor syncs, so its weights are read next by generate.
    (["algo=ppo", "algo.critic_warmup_steps=1"],
     ["generate", "log_probs", "|", "generate", "sync_follows", "log_probs", "train", "sync", "|"]),
])
def test_a_loop_announces_the_sync_only_in_a_step_that_syncs(monkeypatch: pytest.MonkeyPatch, algo: list[str],
                                                             expected: list[str]) -> None:
    from rlbatch.config.compose import compose
    from rlbatch.loop import program

    monkeypatch.setattr(program, "Loop", FakeLoop)
    cfg = compose(algo)
    program.LOOPS.get(str(cfg.algo.name))(None, cfg, None)
    assert FakeLoop.events == expected


@pytest.mark.parametrize(("k", "announced"), [(0, {"actor_infer": {"params"}}), (2, {})])
def test_with_generation_ahead_nothing_is_announced(k: int, announced: dict[str, set[str]]) -> None:
    """max_staleness > 0: the next generation may read the weights before the sync does."""
    from rlbatch.loop.controller import Pipeline
    from rlbatch.loop.program import Loop

    loop = object.__new__(Loop)
    loop.pipe = object.__new__(Pipeline)
    loop.pipe.overwritten_next = {}
    loop.queue, loop.actor_train = SimpleNamespace(k=k), SimpleNamespace(name="actor_train")
    loop.sync_follows()
    assert loop.pipe.overwritten_next == announced
