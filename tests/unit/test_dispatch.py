"""Dispatch: which ranks of a role receive the same samples, from the mesh and the engine's
declared data axes — data-parallel ranks get shares of their own, the tensor/pipeline peers of
one replica share one."""

from __future__ import annotations

from rlbatch.loop.controller import shards
from rlbatch.placement import place


def _role(backend: str, ranks: list[int], name: str = "actor_train"):  # type: ignore[no-untyped-def]
    cfg = {"cluster": {"gpus_per_node": 8}, "roles": {
        "actor_train": {"device_mapping": ranks, "backend": backend},
        "actor_infer": {"device_mapping": ranks, "backend": f"hf:d{len(ranks)}"},
    }}
    role = place(cfg).role(name)
    return role, role.gpu_ranks


def test_data_parallel_ranks_each_get_a_share() -> None:
    role, ranks = _role("fsdp:d4", [0, 1, 2, 3])
    assert shards(role, ranks) == [(0,), (1,), (2,), (3,)]


def test_tensor_and_pipeline_peers_share_their_replica_samples() -> None:
    # megatron mesh (pp, dp, cp, tp) = (2, 2, 1, 2) over ranks 0..7, tp fastest
    role, ranks = _role("megatron:d2t2p2", list(range(8)))
    assert dict(role.mesh) == {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    assert shards(role, ranks) == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_inference_workers_are_the_shards() -> None:
    cfg = {"cluster": {"gpus_per_node": 8}, "roles": {
        "actor_train": {"device_mapping": [0, 1, 2, 3], "backend": "fsdp:d4"},
        "actor_infer": {"device_mapping": [0, 1, 2, 3], "backend": "vllm:d2t2"},
    }}
    role = place(cfg).role("actor_infer")
    assert shards(role, role.gpu_ranks) == [tuple(w) for w in role.workers] == [(0, 1), (2, 3)]


def test_cpu_workers_are_one_rank_each() -> None:
    cfg = {"cluster": {"gpus_per_node": 8}, "roles": {
        "actor_train": {"device_mapping": [0, 1], "backend": "fsdp:d2"},
        "actor_infer": {"device_mapping": [0, 1], "backend": "hf:d2"},
        "reward": {"world_size": 2},
    }}
    role = place(cfg).role("reward")
    ranks = tuple(w[0] for w in role.workers)
    assert shards(role, ranks) == [(r,) for r in ranks]


def test_every_rank_of_an_inference_worker_holds_what_it_generated_and_drops_it_with_the_step() -> None:
    """A tensor-parallel worker's ranks each keep the generated fields: the controller records all
    of them as holders (a phase on any of them reads its own copy; moves come from the first), so
    a finished step's samples are dropped on every one, not on the first rank alone."""
    from collections import defaultdict
    from types import SimpleNamespace

    from rlbatch.loop.controller import PendingRollouts, Pipeline, Rollouts
    from rlbatch.phases import phase_for

    pipe = Pipeline.__new__(Pipeline)
    pipe.where, pipe.length, pipe.shares, pipe.pending_drop = {}, {}, {}, defaultdict(list)
    ro = Rollouts([0, 1], ["a", "a"], 2, {}, {})
    pending = SimpleNamespace(result=lambda: {2: {0: (3, 5, (0, 0)), 1: (3, 4, (0, 0))}})
    PendingRollouts(pipe, phase_for("actor_infer", "generate"), pending, {(2, 3): [0, 1]}, ro).result()  # type: ignore[arg-type]
    assert ro.prompt_len == {0: 3, 1: 3} and ro.response_len == {0: 5, 1: 4}
    assert pipe.where[0]["response"] == {2, 3} and pipe.holder([0, 1]) == {0: 2, 1: 2}
    assert pipe.length[1]["behaviour_logprobs"] == 4 and pipe.length[1]["prompt"] == 3
    pipe.forget([0, 1])
    assert dict(pipe.pending_drop) == {2: [0, 1], 3: [0, 1]} and pipe.where == {}


def test_a_roles_phases_on_one_batch_see_one_assignment_though_the_data_moves_between_them() -> None:
    """The old log-probs of a 2-mini-batch batch are taken for its second half only, which moves
    that half onto the trainer first; training then must still cut its mini-batches from the same
    order (it once put the moved half first and found no old log-probs for its second mini-batch)."""
    from types import SimpleNamespace

    from rlbatch.loop.controller import Role, Rollouts

    cfg = {"cluster": {"gpus_per_node": 8}, "roles": {
        "actor_train": {"device_mapping": [0], "backend": "fsdp:d1"},
        "actor_infer": {"device_mapping": [1], "backend": "hf:d1"}}}
    held = {sid: 1 for sid in range(8)}
    pipe = SimpleNamespace(p=place(cfg), world=SimpleNamespace(members={"actor_train": (0,), "actor_infer": (1,)}),
                           holder=lambda ids, field="response": {i: held[i] for i in ids})
    role = Role(pipe, "actor_train")  # type: ignore[arg-type]
    ro = Rollouts(list(range(8)), ["a"] * 8, 4, {}, {})
    first = role._assign(ro)
    assert first == {(0,): list(range(8))}
    held.update({sid: 0 for sid in range(4, 8)})  # the second half moved onto the trainer
    assert role._assign(ro) == first
    nxt = Rollouts(list(range(8, 16)), ["a"] * 8, 4, {}, {})
    held.update({sid: 1 for sid in range(8, 16)})
    assert role._assign(nxt) == {(0,): list(range(8, 16))}
