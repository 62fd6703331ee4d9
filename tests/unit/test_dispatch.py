"""Dispatch: which ranks of a role receive the same samples, from the mesh and the engine's
declared data axes — data-parallel ranks get shares of their own, the tensor/pipeline peers of
one replica share one."""

from __future__ import annotations

from rlbatch.placement import place
from rlbatch.scheduler.controller import shards


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
