"""Asynchronous off-policy training: the generation schedule and its staleness bound, the
off-policy corrections written out by hand, the per-role idle and overlap metrics, validation."""

from __future__ import annotations

import copy
import dataclasses
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbatch.algos.objective import LossInput, PolicyObjective
from rlbatch.algos.offpolicy import importance_ratio, ratio_mask, truncated_is
from rlbatch.algos.registry import OFF_POLICY
from rlbatch.checks.validate import check
from rlbatch.config.schema import AlgoConfig, RLBatchConfig
from rlbatch.loop.ahead import GenerationQueue
from rlbatch.loop.controller import Rollouts
from rlbatch.loop.metrics import idle_and_overlap
from tests.unit.configs import problems

# ------------------------------------------------------------------ the schedule


class FakeGeneration:
    def __init__(self, log: list[tuple[str, int, int]], step: int, version: int) -> None:
        self.log, self.step, self.version = log, step, version

    def result(self) -> Rollouts:
        return Rollouts([self.step], ["a"], 1, {self.step: 1}, {self.step: 1}, self.version)


class FakeInfer:
    """Records the order of commands the inference ranks would receive."""

    def __init__(self, log: list[tuple[str, int, int]]) -> None:
        self.log = log

    def start_generate(self, prompts: list[Any], n: int, first_id: int, seed: int, version: int) -> Any:
        step = prompts[0]
        self.log.append(("generate", step, version))
        return FakeGeneration(self.log, step, version)


class FakeConsumer:
    def __init__(self, log: list[tuple[str, int, int]]) -> None:
        self.log = log

    def receive(self, ro: Rollouts, also: tuple[str, ...] = ()) -> Any:
        self.log.append(("receive", ro.ids[0], ro.version))
        return SimpleNamespace(result=lambda: None)


class Counter:
    def __init__(self) -> None:
        self.next = 0

    def next_batch(self, p: int) -> list[int]:
        self.next += 1
        return [self.next - 1]


def schedule(k: int, steps: int) -> tuple[list[tuple[str, int, int]], list[tuple[int, int]]]:
    """Drive the queue as the policy-gradient loop does: take, train (version + 1), sync.
    Returns the command log and (step, staleness) of each trained batch."""
    log: list[tuple[str, int, int]] = []
    cfg = SimpleNamespace(steps=steps, seed=0, algo=SimpleNamespace(prompts_per_step=1, samples_per_prompt=1))
    scoring = SimpleNamespace(start=lambda ro: log.append(("score", ro.ids[0], ro.version)))
    q = GenerationQueue(FakeInfer(log), [FakeConsumer(log)], scoring, Counter(), cfg, k)  # type: ignore[arg-type]
    version, trained = 0, []
    for step in range(steps):
        ro = q.take(step)
        trained.append((step, version - ro.version))
        log.append(("train", step, version))
        version += 1
        q.synced(version)
        log.append(("sync", step, version))
    return log, trained


def test_synchronous_schedule_generates_each_step_with_the_newest_weights() -> None:
    log, trained = schedule(0, 3)
    assert [e for e in log if e[0] == "generate"] == [("generate", 0, 0), ("generate", 1, 1), ("generate", 2, 2)]
    assert trained == [(0, 0), (1, 0), (2, 0)]
    assert all(e[0] != "receive" for e in log)  # nothing to take off the inference ranks early


@pytest.mark.parametrize("k", [1, 2, 3])
def test_generation_runs_k_steps_ahead_and_staleness_never_exceeds_k(k: int) -> None:
    steps = 7
    log, trained = schedule(k, steps)
    gens = [e for e in log if e[0] == "generate"]
    # Every step generated exactly once, in order, with the weights after update j - k; the k steps
    # after the last are generated too (a later, longer run trains on them from the checkpoint).
    assert [g[1] for g in gens] == list(range(steps + k))
    assert [g[2] for g in gens] == [max(0, j - k) for j in range(steps + k)]
    assert trained == [(j, min(j, k)) for j in range(steps)]
    for j in range(steps - k):
        # Step j+k starts generating before step j trains: that is the overlap. Step j's samples
        # leave the inference ranks before it starts.
        assert log.index(("generate", j + k, max(0, j))) < log.index(("train", j, j))
        assert log.index(("receive", j, max(0, j - k))) < log.index(("generate", j + k, max(0, j)))


# ------------------------------------------------------------------ corrections


def test_importance_ratio_and_the_registered_corrections() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    behaviour = torch.tensor([[-1.0, -1.0, -2.0]])
    ratio = importance_ratio(old, behaviour)
    assert torch.allclose(ratio, torch.tensor([[1.0, math.exp(-1.0), math.exp(1.5)]]))
    algo = AlgoConfig(tis_cap=2.0, mask_ratio_low=0.5, mask_ratio_high=2.0)
    mask = torch.ones_like(ratio)
    weight, keep = truncated_is(ratio, mask, algo)
    assert torch.allclose(weight, torch.tensor([[1.0, math.exp(-1.0), 2.0]])) and keep.eq(1).all()
    weight, keep = ratio_mask(ratio, mask, algo)
    assert weight.eq(1).all() and keep.tolist() == [[1.0, 0.0, 0.0]]  # e^-1 < 0.5 and e^1.5 > 2 leave
    assert OFF_POLICY.names() == ["mask", "none", "seq_mask", "seq_tis", "tis"]


def test_tis_weighs_each_token_of_the_policy_loss() -> None:
    """With old = current (the first update) the PPO-clip per-token loss is -A; TIS makes it
    -min(r, cap) A, averaged over the response tokens."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    a = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    behaviour = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, -1.0, 0.0]])
    fields = {"old_logprobs": logp.clone(), "behaviour_logprobs": behaviour}
    loss, stats = PolicyObjective(AlgoConfig(kl_coef=0.0, off_policy="tis", tis_cap=2.0))(LossInput(logp, mask, a, fields))
    w = [1.0, math.exp(-1.0), 2.0, math.exp(-0.5), 1.0]  # the 5 response tokens; e^1.5 capped at 2
    adv = [1.0, 1.0, 1.0, -2.0, -2.0]
    assert loss.item() == pytest.approx(-sum(x * y for x, y in zip(w, adv, strict=True)) / 5, abs=1e-6)
    assert stats["offpolicy/truncated_frac"] == pytest.approx(1 / 5)
    assert stats["offpolicy/weight_mean"] == pytest.approx(sum(w) / 5, abs=1e-6)
    plain, plain_stats = PolicyObjective(AlgoConfig(kl_coef=0.0))(LossInput(logp, mask, a, fields))
    assert plain.item() == pytest.approx(-sum(adv) / 5, abs=1e-6)  # 'none' reads no behaviour log-probs
    assert not any(k.startswith("offpolicy/") for k in plain_stats)


def test_masking_takes_tokens_out_of_the_loss_and_its_count() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.ones(1, 3)
    a = torch.tensor([[1.0, 2.0, 4.0]])
    fields = {"old_logprobs": logp.clone(), "behaviour_logprobs": torch.tensor([[-1.0, -1.0, -2.0]])}
    loss, stats = PolicyObjective(AlgoConfig(kl_coef=0.0, off_policy="mask"))(LossInput(logp, mask, a, fields))
    assert loss.item() == pytest.approx(-1.0)  # only the first token stays, weight 1, count 1
    assert stats["offpolicy/masked_frac"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------ metrics


def rec(phase: str, roles: tuple[str, ...], rank: int, seconds: float) -> dict[str, Any]:
    return {"phase": phase, "roles": roles, "rank": rank, "seconds": seconds}


def test_idle_and_overlap_by_hand() -> None:
    records = [rec("generate", ("actor_infer",), 1, 3.0), rec("train", ("actor_train",), 0, 2.5),
               rec("old_logprobs", ("actor_train",), 0, 0.5), rec("sync", ("actor_train", "actor_infer"), 0, 0.2),
               rec("sync", ("actor_train", "actor_infer"), 1, 0.2)]
    out = idle_and_overlap(records, 4.0)
    assert out["idle/actor_infer"] == pytest.approx(4.0 - 3.2)
    assert out["idle/actor_train"] == pytest.approx(4.0 - 3.2)
    assert out["overlap/generate_train"] == pytest.approx(3.0 + 2.5 - 4.0)
    colocated = idle_and_overlap([rec("generate", ("actor_infer",), 0, 1.0), rec("train", ("actor_train",), 0, 1.0)], 2.0)
    assert "overlap/generate_train" not in colocated  # the same ranks cannot overlap


def test_a_steps_records_reduce_by_hand() -> None:
    """Offload and reload summed per rank, then the most of any rank; memory and host RSS the most
    of any record (per role, per phase); each phase's span from its earliest start to its latest end."""
    from rlbatch.loop.metrics import reduce_records, timeline

    def full(phase: str, roles: tuple[str, ...], rank: int, seconds: float, started: float, off: tuple[int, float],
             back: tuple[int, float], peak: int, reserved: int, rss: int, rss_peak: int = 0,
             startup: int = 0) -> dict[str, Any]:
        return rec(phase, roles, rank, seconds) | {
            "started": started, "offload": {"bytes": off[0], "seconds": off[1], "tensors": 1},
            "reload": {"bytes": back[0], "seconds": back[1], "tensors": 1}, "peak_allocated": peak,
            "mem_reserved_after": reserved, "rss_after": rss, "rss_peak": rss_peak, "rss_peak_startup": startup}

    records = [full("generate", ("actor_infer",), 0, 2.0, 100.0, (10, 0.1), (0, 0.0), 50, 70, 5, 9, 30),
               full("generate", ("actor_infer",), 1, 3.0, 100.5, (0, 0.0), (4, 0.2), 40, 80, 6, 8),
               full("train", ("actor_train",), 0, 1.0, 103.0, (0, 0.0), (20, 0.3), 90, 60, 7, 12),
               full("train", ("actor_train",), 1, 1.5, 103.2, (15, 0.4), (0, 0.0), 0, 0, 4)]
    assert reduce_records(records) == {
        "offload/bytes": 15, "reload/bytes": 20, "time/offload": 0.4, "time/reload": 0.3,
        "mem/actor_infer/peak_allocated": 50.0, "mem/actor_train/peak_allocated": 90.0, "mem/reserved": 80.0,
        "host/rss": 7.0, "host/peak/generate": 9.0, "host/peak/train": 12.0, "host/peak/startup": 30.0}
    assert timeline(records, 101.0) == {"at/generate/start": -1.0, "at/generate/end": 2.5,
                                        "at/train/start": 2.0, "at/train/end": pytest.approx(3.7)}


# ------------------------------------------------------------------ validation


def config(tmp_path: Path, **algo: Any) -> dict[str, Any]:
    c = dataclasses.asdict(RLBatchConfig())
    c["run_dir"] = str(tmp_path / "run")
    c = copy.deepcopy(c)
    c["algo"].update(algo)
    return c



def test_async_settings_are_validated(tmp_path: Path) -> None:
    check(config(tmp_path, max_staleness=2, off_policy="tis"))
    assert problems(config(tmp_path, max_staleness=-1)) == ["algo.max_staleness: must be >= 0, got -1"]
    assert problems(config(tmp_path, off_policy="icepop")) == [
        "algo.off_policy: 'icepop' is not a registered off-policy correction; registered: ['mask', 'none', 'seq_mask', 'seq_tis', 'tis']"]
    assert problems(config(tmp_path, tis_cap=0.5)) == ["algo.tis_cap: must be >= 1, got 0.5"]
    (line,) = problems(config(tmp_path, max_staleness=1, dynamic_sampling=True))
    assert line.startswith("algo.max_staleness: asynchronous generation (1 steps ahead) is not built for DAPO")
    (line,) = problems(config(tmp_path, off_policy="tis", temperature=0.7))
    assert line.startswith("algo.off_policy: 'tis' weighs tokens") and "temperature=0.7" in line
    assert problems(config(tmp_path, off_policy="mask", mask_ratio_low=1.5, mask_ratio_high=0.5)) == [
        "algo.mask_ratio_low: must be in (0, 1], got 1.5", "algo.mask_ratio_high: must be >= 1, got 0.5"]


def roles_on(backends: dict[str, tuple[list[int], str]]) -> dict[str, Any]:
    """Controller role handles for a placement of ``backends`` (role -> device_mapping, backend),
    a reward on a CPU worker beside them; world ranks are the GPU indices."""
    from rlbatch.loop.controller import Role
    from rlbatch.placement import place

    placement = place({"cluster": {"gpus_per_node": 8}, "roles": {
        role: {"device_mapping": dm, "backend": backend} for role, (dm, backend) in backends.items()}})
    members = {role: tuple(dm) for role, (dm, _) in backends.items()} | {"reward": (8,)}
    pipe = SimpleNamespace(p=placement, world=SimpleNamespace(members=members), cfg=SimpleNamespace(algo=AlgoConfig()))
    return {"pipe": pipe} | {role: Role(pipe, role) for role in backends}  # type: ignore[arg-type]


def test_a_placement_where_inference_shares_ranks_runs_synchronously_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    from rlbatch.loop.ahead import async_plan

    def plan(infer: list[int], reference: list[int], k: int = 2) -> tuple[int, Any]:
        r = roles_on({"actor_train": ([0], "fsdp:d1"), "actor_infer": (infer, f"hf:d{len(infer)}"),
                      "reference": (reference, "fsdp:d1")})
        return async_plan(r["pipe"], r["actor_infer"], r["reference"], k)

    assert plan([1], [0]) == (2, None) and capsys.readouterr().out == ""
    assert plan([0, 1], [0]) == (0, None)
    assert "shares its ranks with actor_train, reference" in capsys.readouterr().out
    assert plan([1], [0], k=0) == (0, None) and capsys.readouterr().out == ""
    # The reference alone on the inference rank rides along: asynchronous, no note.
    k, rider = plan([1], [1])
    assert k == 2 and rider.role.name == "reference" and rider.on == {(1,): [(1,)]} and capsys.readouterr().out == ""
    assert rider.field == "ref_logprobs"
    # On one of two inference workers' ranks it cannot: synchronous, and the note says when it could.
    r = roles_on({"actor_train": ([0], "fsdp:d1"), "actor_infer": ([1, 2], "hf:d2"), "reference": ([1], "fsdp:d1")})
    assert async_plan(r["pipe"], r["actor_infer"], r["reference"], 1) == (0, None)
    assert "each of its shards lies inside one inference worker" in capsys.readouterr().out


@pytest.mark.parametrize(("infer", "reference", "on"), [
    (([1, 2], "vllm:d1t2"), ([1, 2], "fsdp:d2"), {(1, 2): [(1,), (2,)]}),  # two shards inside one worker
    (([1, 2], "vllm:d2"), ([1, 2], "fsdp:d2"), {(1,): [(1,)], (2,): [(2,)]}),
    (([1, 2], "vllm:d1t2"), ([1, 2], "megatron:t2"), {(1, 2): [(1, 2)]}),
    (([1, 2], "vllm:d2"), ([1, 2], "megatron:t2"), None),  # a shard across two workers
    (([1, 2], "vllm:d2"), ([1], "fsdp:d1"), None),  # worker (2,) would need its samples moved first
    (([1], "vllm:d1"), ([2], "fsdp:d1"), None),  # elsewhere: works where it is placed
])
def test_the_reference_rides_on_the_inference_ranks_when_each_shard_lies_inside_one_worker(
        infer: tuple[list[int], str], reference: tuple[list[int], str], on: Any) -> None:
    """Every rank of an inference worker holds what it generated, so a reference shard inside a
    worker can take its log-probs there with no data moved; each worker needs a shard."""
    from rlbatch.loop.ahead import rider_for

    r = roles_on({"actor_train": ([0], "fsdp:d1"), "actor_infer": infer, "reference": reference})
    rider = rider_for(r["actor_infer"], r["reference"])
    assert (rider.on if rider is not None else None) == on


def test_a_riding_reference_splits_each_workers_samples_over_its_shards_with_nothing_moved() -> None:
    """Queued behind the generation on the same ranks: no data moves (the start carries none), and
    once both are done the reference's log-probs are recorded as held by each shard's first rank."""
    from rlbatch.loop.ahead import Ahead, rider_for

    r = roles_on({"actor_train": ([0], "fsdp:d1"), "actor_infer": ([1, 2], "vllm:d1t2"),
                  "reference": ([1, 2], "fsdp:d2")})
    from rlbatch.loop.controller import Pipeline

    pipe, started = r["pipe"], []
    pipe.start = lambda phase, roles, work, need=None: started.append((phase, work, need)) or SimpleNamespace(
        result=lambda: {})
    pipe.hold = partial(Pipeline.hold, pipe)
    pipe.where, pipe.length = {}, {sid: {"response": 5 + sid} for sid in range(4)}
    ro = Rollouts([0, 1, 2, 3], ["a"] * 4, 2, {}, {})
    gen = SimpleNamespace(ids_of={(1, 2): [0, 1, 2, 3]}, result=lambda: ro, kept=None)
    rider = rider_for(r["actor_infer"], r["reference"])
    assert rider is not None
    ahead = Ahead(gen, rider)  # type: ignore[arg-type]
    assert started == [("ref_logprobs", {1: {"ids": [0, 1]}, 2: {"ids": [2, 3]}}, {1: ([0, 1], []), 2: ([2, 3], [])})]
    assert pipe.where == {}
    assert ahead.result() is ro
    assert pipe.where == {0: {"ref_logprobs": {1}}, 1: {"ref_logprobs": {1}}, 2: {"ref_logprobs": {2}},
                          3: {"ref_logprobs": {2}}}
    assert [pipe.length[sid]["ref_logprobs"] for sid in range(4)] == [5, 6, 7, 8]


@pytest.mark.parametrize(("correction", "fields"), [
    ("none", ["image_grid_thw", "loss_mask", "pixel_values", "prompt", "response"]),
    ("tis", ["behaviour_logprobs", "image_grid_thw", "loss_mask", "pixel_values", "prompt", "response"])])
def test_the_trainer_takes_off_the_inference_ranks_every_field_it_will_read(correction: str, fields: list[str]) -> None:
    """``receive`` moves what the trainer's phases read, its objective's extra reads included (the
    behaviour log-probs of a correction): otherwise its training phase would fetch them from an
    inference rank busy with the next generation. (``loss_mask`` is asked for too: a multi-turn
    rollout writes it; a sample without one has nothing to move, ``Pipeline._moves``.)"""
    from rlbatch.loop.controller import Role
    from rlbatch.placement import place

    placement = place({"cluster": {"gpus_per_node": 8}, "roles": {
        "actor_train": {"device_mapping": [0], "backend": "fsdp:d1"},
        "actor_infer": {"device_mapping": [1], "backend": "hf:d1"}}})
    calls: list[tuple[str, Any]] = []
    pipe = SimpleNamespace(p=placement, world=SimpleNamespace(members={"actor_train": (0,), "actor_infer": (1,)}),
                           cfg=SimpleNamespace(algo=AlgoConfig(off_policy=correction)),
                           holder=lambda ids, field="response": {i: 1 for i in ids},
                           start=lambda phase, roles, work, need=None: calls.append((phase, need)))
    Role(pipe, "actor_train").receive(Rollouts([0, 1], ["a", "b"], 2, {0: 1, 1: 1}, {0: 1, 1: 1}))  # type: ignore[arg-type]
    assert calls == [("receive", {0: ([0, 1], fields)})]


def test_a_checkpoint_keeps_every_buffered_generation_whether_or_not_the_reference_rode_on_it(tmp_path: Path) -> None:
    """The generated fields are read from the rank that holds them, the rider's log-probs from
    theirs where taken: a step restored from a checkpoint saved without them (not yet trained, as
    with max_staleness=2) is written again with its samples, and loads as still lacking them."""
    from rlbatch.loop.ahead import ROLLOUTS_FILE, Rider

    generated = ("prompt", "response", "behaviour_logprobs", "token_versions")
    where = {(sid, f): 1 for sid in range(4) for f in generated} | {(sid, "ref_logprobs"): 2 for sid in (0, 1)}
    reads: list[tuple[int, list[int], list[str]]] = []

    def run(phase: str, roles: tuple[str, ...], work: dict[int, dict[str, Any]]) -> dict[int, Any]:
        assert phase == "rollout_buffer"
        for r, w in work.items():
            assert all(where[(sid, f)] == r for sid in w["ids"] for f in w["fields"]), (r, w)
            reads.append((r, w["ids"], w["fields"]))
        return {r: {sid: {f: torch.tensor([float(sid)]) for f in w["fields"]} for sid in w["ids"]}
                for r, w in work.items()}

    pipe = SimpleNamespace(holder=lambda ids, field="response": {i: where[(i, field)] for i in ids if (i, field) in where},
                           run=run, settle=lambda: None)  # no answer outstanding (an in-flight sync's)
    infer = SimpleNamespace(pipe=pipe, name="actor_infer")
    reference = SimpleNamespace(name="reference")
    cfg = SimpleNamespace(seed=0, algo=SimpleNamespace(prompts_per_step=1, samples_per_prompt=2))
    q = GenerationQueue(infer, [], SimpleNamespace(), None, cfg, 2, Rider(reference, {(1,): [(2,)]}))  # type: ignore[arg-type]
    q.ahead = {3: Rollouts([0, 1], ["a", "a"], 2, {}, {}), 4: Rollouts([2, 3], ["a", "a"], 2, {}, {})}
    q.save(tmp_path)
    saved = torch.load(tmp_path / ROLLOUTS_FILE)
    held = [{sid: sorted(fields) for sid, fields in e["samples"].items()} for e in saved["entries"]]
    assert held == [{0: sorted([*generated, "ref_logprobs"]), 1: sorted([*generated, "ref_logprobs"])},
                    {2: sorted(generated), 3: sorted(generated)}]
    assert reads == [(1, [0, 1], list(generated)), (2, [0, 1], ["ref_logprobs"]), (1, [2, 3], list(generated))]
    restored = SimpleNamespace(run=lambda *a: {}, produced=lambda *a: None)
    again = GenerationQueue(SimpleNamespace(pipe=restored, name="actor_infer", placement=SimpleNamespace(workers=[(1,)])),
                            [], SimpleNamespace(), None, cfg, 2, Rider(reference, {(1,): [(2,)]}))  # type: ignore[arg-type]
    again.load(tmp_path, {"policy_version": 2})
    assert sorted(again.ahead) == [3, 4] and again.unridden == {4}
