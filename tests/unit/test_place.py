"""``place(cfg) -> Placement``: the reference examples, every validation rule, and properties."""

from __future__ import annotations

import copy
import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbatch import ConfigError
from rlbatch.checks.validate import check
from rlbatch.placement import Placement, ProcessKind, SlurmRequest, parse_backend, parse_device_mapping, place

DELETE = object()
"""In a patch: remove this key from the base config."""


def merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if v is DELETE:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v) if isinstance(v, dict) else copy.deepcopy(v)
    return out


BASE: dict[str, Any] = {
    "cluster": {"gpus_per_node": 8},
    "roles": {
        "actor_train": {"device_mapping": [0, 1], "backend": "fsdp:d2"},
        "actor_infer": {"device_mapping": [0, 1], "backend": "hf:d2"},
    },
}


def cfg_with(roles: dict[str, Any] | None = None, cluster: dict[str, Any] | None = None) -> dict[str, Any]:
    return merge(BASE, {"roles": roles or {}, "cluster": cluster or {}})


def problems_of(cfg: Any) -> list[str]:
    with pytest.raises(ConfigError) as e:
        place(cfg)
    assert e.value.problems, "a ConfigError must carry its problems"
    return e.value.problems


def as_json_types(obj: Any) -> Any:
    """What JSON gives back for ``obj``: tuples become lists."""
    if isinstance(obj, dict):
        return {k: as_json_types(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_json_types(v) for v in obj]
    return obj


def assert_json_round_trip(p: Placement) -> dict[str, Any]:
    d = p.to_dict()
    back = json.loads(json.dumps(d, allow_nan=False))
    assert back == as_json_types(d)
    assert back["world_size"] == p.world_size and len(back["processes"]) == p.world_size
    assert set(back["roles"]) == set(p.roles)
    return back


# --------------------------------------------------------------------------- ROLL's examples


def test_roll_24_gpu_split() -> None:
    """actor_train on GPUs [0,16), actor_infer on [16,24): 24 GPUs, 3 nodes, nothing shared."""
    p = place(cfg_with({
        "actor_train": {"device_mapping": "list(range(0,16))", "backend": "fsdp:d16"},
        "actor_infer": {"device_mapping": "list(range(16,24))", "backend": "vllm:d8"},
    }))
    assert (p.num_gpus, p.num_nodes, p.gpus_per_node) == (24, 3, 8)
    train, infer = p.role("actor_train"), p.role("actor_infer")
    assert train.gpu_ranks == tuple(range(16)) and infer.gpu_ranks == tuple(range(16, 24))
    assert (train.world_size, infer.world_size) == (16, 8)
    assert train.workers == tuple((r,) for r in range(16))
    assert train.nodes == (0,) * 8 + (1,) * 8
    assert infer.nodes == (2,) * 8
    assert p.colocated_sets == () and train.colocated_with == () and infer.colocated_with == ()
    assert [s.node for s in p.processes[:24]] == [r // 8 for r in range(24)]
    assert [s.local_gpu for s in p.processes[:24]] == [r % 8 for r in range(24)]
    assert p.roles_on_gpu(15) == ("actor_train",) and p.roles_on_gpu(16) == ("actor_infer",)
    assert p.world_size == 25 and p.controller_rank == 24
    assert p.processes[24].kind is ProcessKind.CONTROLLER and p.processes[24].node == 0
    assert p.slurm == SlurmRequest(nodes=3, ntasks_per_node=9, gpus_per_node=8, cpus_per_task=1)
    assert p.slurm.ntasks == 27
    assert_json_round_trip(p)


def test_roll_mixed_16_gpu_train_12_gpu_infer_8_cpu_sandbox() -> None:
    """ROLL's complete example: world sizes 16 (train), 6 (infer, 2 GPUs each), 8 (CPU)."""
    p = place(cfg_with({
        "actor_train": {"device_mapping": "list(range(0,16))", "backend": "fsdp:d16"},
        "actor_infer": {"num_gpus_per_worker": 2, "device_mapping": "list(range(0,12))", "backend": "vllm:d6t2"},
        "code_sandbox": {"world_size": 8},
    }))
    train, infer, sandbox = p.role("actor_train"), p.role("actor_infer"), p.role("code_sandbox")
    assert (train.world_size, infer.world_size, sandbox.world_size) == (16, 6, 8)
    assert (train.num_gpus_per_worker, infer.num_gpus_per_worker, sandbox.num_gpus_per_worker) == (1, 2, 0)
    assert infer.workers == ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11))
    assert infer.nodes == (0, 0, 0, 0, 1, 1)
    assert (p.num_gpus, p.num_nodes) == (16, 2)
    # GPU ranks 0-11 host both roles; 12-15 only actor_train.
    assert p.processes[3].roles == (("actor_train", 3), ("actor_infer", 1))
    assert p.processes[12].roles == (("actor_train", 12),)
    assert p.colocated_sets == (("actor_train", "actor_infer"),)
    assert train.colocated_with == ("actor_infer",) and infer.colocated_with == ("actor_train",)
    # CPU workers: their own processes after the GPU ranks, spread evenly over both nodes.
    assert sandbox.engine == "cpu" and sandbox.gpu_ranks == () and not sandbox.is_gpu
    assert [w[0] for w in sandbox.workers] == list(range(16, 24))
    assert Counter(sandbox.nodes) == {0: 4, 1: 4}
    for w, (rank,) in enumerate(sandbox.workers):
        slot = p.processes[rank]
        assert slot.kind is ProcessKind.CPU and slot.gpu_rank is None and slot.local_gpu is None
        assert slot.roles == (("code_sandbox", w),) and slot.node == sandbox.nodes[w]
    assert p.controller_rank == 24 and p.processes[24].node == 0
    assert p.slurm == SlurmRequest(nodes=2, ntasks_per_node=13, gpus_per_node=8, cpus_per_task=1)
    assert p.slurm.ntasks - p.world_size == 1  # node 1 has one spare slot
    d = assert_json_round_trip(p)
    assert d["roles"]["actor_infer"]["workers"][0] == [0, 1]
    assert d["roles"]["code_sandbox"]["engine"] == "cpu" and d["roles"]["code_sandbox"]["backend"] is None
    assert d["world_size"] == 25 and d["controller_rank"] == 24 and d["slurm"]["ntasks"] == 26


def test_roll_num_gpus_per_worker_is_derived_from_vllm_tp() -> None:
    p = place(cfg_with({
        "actor_train": {"device_mapping": "list(range(0,12))", "backend": "fsdp:d12"},
        "actor_infer": {"device_mapping": "list(range(0,12))", "backend": "vllm:d6t2"},
    }))
    assert p.role("actor_infer").num_gpus_per_worker == 2 and p.role("actor_infer").world_size == 6


@pytest.mark.parametrize(
    ("given_fields", "ngpw", "world"),
    [({"world_size": 4}, 2, 4), ({"num_gpus_per_worker": 2}, 2, 4), ({"num_gpus_per_worker": 2, "world_size": 4}, 2, 4), ({}, 2, 4)],
)
def test_only_one_of_gpus_per_worker_or_world_size_derives_the_other(given_fields: dict[str, int], ngpw: int, world: int) -> None:
    p = place(cfg_with({
        "actor_train": {"device_mapping": "range(8)", "backend": "fsdp:d8", "world_size": 8},
        "actor_infer": {"device_mapping": "range(8)", "backend": "vllm:d4t2", **given_fields},
    }))
    infer = p.role("actor_infer")
    assert (infer.num_gpus_per_worker, infer.world_size) == (ngpw, world)
    assert p.role("actor_train").world_size == 8


def test_roll_colocated_8_gpus() -> None:
    p = place(cfg_with({
        "actor_train": {"device_mapping": "list(range(0,8))", "backend": "fsdp:d8"},
        "actor_infer": {"device_mapping": "list(range(0,8))", "backend": "vllm:d8"},
        "reference": {"device_mapping": "list(range(0,8))", "backend": ""},
    }))
    assert (p.num_gpus, p.num_nodes, p.world_size) == (8, 1, 9)
    assert p.colocated_sets == (("actor_train", "actor_infer", "reference"),)
    assert p.role("reference").colocated_with == ("actor_train", "actor_infer")
    for r in range(8):
        assert p.processes[r].roles == (("actor_train", r), ("actor_infer", r), ("reference", r))
        assert p.roles_on_gpu(r) == ("actor_train", "actor_infer", "reference")
    assert p.slurm == SlurmRequest(nodes=1, ntasks_per_node=9, gpus_per_node=8, cpus_per_task=1)


def test_roll_disaggregated_8_gpus() -> None:
    p = place(cfg_with({
        "actor_train": {"device_mapping": "list(range(0,4))", "backend": "fsdp:d4"},
        "actor_infer": {"device_mapping": "list(range(4,8))", "backend": "vllm:d4"},
    }))
    assert p.num_gpus == 8 and p.colocated_sets == ()
    assert [p.roles_on_gpu(r) for r in range(8)] == [("actor_train",)] * 4 + [("actor_infer",)] * 4
    assert p.role("actor_infer").workers == ((4,), (5,), (6,), (7,))
    assert p.role("actor_infer").colocated_with == ()


def test_colocated_sets_join_through_shared_ranks() -> None:
    """a shares with b, b with c: one set of three although a and c share nothing."""
    p = place(cfg_with({
        "actor_train": {"device_mapping": [0, 1], "backend": "fsdp:d2"},
        "actor_infer": {"device_mapping": [1, 2], "backend": "hf:d2"},
        "reference": {"device_mapping": [2, 3], "backend": "fsdp:d2"},
        "critic": {"device_mapping": [4], "backend": "fsdp:d1"},
    }))
    assert p.colocated_sets == (("actor_train", "actor_infer", "reference"),)
    assert p.role("critic").colocated_with == ()


def test_device_mapping_order_is_kept() -> None:
    p = place(cfg_with({
        "actor_train": {"device_mapping": "[3, 2, 1, 0]", "backend": "fsdp:d4"},
        "actor_infer": {"device_mapping": "[2, 3] + [0, 1]", "backend": "vllm:d2t2"},
    }))
    assert p.role("actor_train").workers == ((3,), (2,), (1,), (0,))
    assert p.role("actor_infer").workers == ((2, 3), (0, 1))
    assert p.processes[0].roles == (("actor_train", 3), ("actor_infer", 1))


# --------------------------------------------------------------------------- AReaL's examples


@pytest.mark.parametrize(
    ("backend", "gpus", "world", "gpus_per_worker", "first_worker"),
    [
        ("fsdp:d8", 8, 8, 1, (0,)),
        ("sglang:d2t4", 8, 2, 4, (0, 1, 2, 3)),
        ("megatron:d2p2t4", 16, 16, 1, (0,)),
        ("megatron:d2p2t4e4", 16, 16, 1, (0,)),
    ],
)
def test_areal_table(backend: str, gpus: int, world: int, gpus_per_worker: int, first_worker: tuple[int, ...]) -> None:
    role = "actor_infer" if backend.startswith("sglang") else "actor_train"
    other = "actor_train" if role == "actor_infer" else "actor_infer"
    p = place(cfg_with({
        role: {"device_mapping": f"list(range(0,{gpus}))", "backend": backend},
        other: {"device_mapping": f"list(range(0,{gpus}))", "backend": "hf:d" + str(gpus) if other == "actor_infer" else f"fsdp:d{gpus}"},
    }))
    r = p.role(role)
    assert len(r.gpu_ranks) == gpus == parse_backend(backend).world_size
    assert (r.world_size, r.num_gpus_per_worker, r.workers[0]) == (world, gpus_per_worker, first_worker)
    assert r.backend == parse_backend(backend)


def test_areal_16_gpu_full_example() -> None:
    p = place(cfg_with({
        "actor_infer": {"device_mapping": "list(range(0,8))", "backend": "sglang:d2t4"},
        "actor_train": {"device_mapping": "list(range(8,16))", "backend": "fsdp:d4t2"},
    }))
    assert p.num_gpus == 16 and p.num_nodes == 2 and p.colocated_sets == ()
    assert p.role("actor_infer").workers == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert p.role("actor_train").world_size == 8 and p.role("actor_train").nodes == (1,) * 8
    assert dict(p.role("actor_train").mesh) == {"pp": 1, "dp": 4, "cp": 1, "tp": 2}
    assert dict(p.role("actor_infer").mesh) == {"dp": 2, "pp": 1, "tp": 4}


@pytest.mark.parametrize("ffn", ["d2p2t4e2", "p2t4e2"])
def test_areal_moe_hybrid_32_gpus(ffn: str) -> None:
    p = place(cfg_with({
        "actor_train": {"device_mapping": "list(range(0,32))", "backend": f"megatron:(attn:d4p2t2c2|ffn:{ffn})"},
        "actor_infer": {"device_mapping": "list(range(0,32))", "backend": "vllm:d4t8"},
        "reference": {"device_mapping": "list(range(0,32))", "backend": ""},
    }))
    train = p.role("actor_train")
    assert train.world_size == 32 and train.backend is not None and train.backend.world_size == 32
    assert train.backend.ffn is not None and train.backend.ffn.d == 2  # derived when omitted
    assert p.role("reference").backend == train.backend  # empty backend inherits actor_train's
    assert p.num_nodes == 4 and p.slurm.nodes == 4
    d = assert_json_round_trip(p)
    assert d["roles"]["actor_train"]["backend"]["ffn"]["world_size"] == 32


@pytest.mark.parametrize("role", ["reference", "critic"])
def test_reference_and_critic_inherit_actor_train_backend(role: str) -> None:
    p = place(cfg_with({
        "actor_train": {"device_mapping": "range(4)", "backend": "fsdp:d2t2"},
        "actor_infer": {"device_mapping": "range(4)", "backend": "vllm:d4"},
        role: {"device_mapping": "range(4)", "backend": ""},
    }))
    assert p.role(role).backend == parse_backend("fsdp:d2t2")
    assert p.role(role).engine == "fsdp"


def test_a_critic_without_gpus_of_its_own_runs_on_actor_train_s() -> None:
    p = place(cfg_with({
        "actor_train": {"device_mapping": [2, 3], "backend": "fsdp:d2"},
        "actor_infer": {"device_mapping": [0, 1], "backend": "hf:d2"},
        "reference": None,
        "critic": {"enabled": True},
    }))
    assert p.role("critic").gpu_ranks == (2, 3) and p.role("critic").engine == "fsdp"
    assert "actor_train" in p.role("critic").colocated_with
    own = place(cfg_with({"actor_infer": {"device_mapping": [0, 1], "backend": "hf:d2"},
                          "critic": {"device_mapping": [2], "backend": "deepspeed:d1"}}))
    assert own.role("critic").gpu_ranks == (2,) and own.role("critic").colocated_with == ()


def test_reward_is_a_gpu_role_only_when_given_gpus() -> None:
    cpu = place(cfg_with({"reward": {"world_size": 3}}))
    gpu = place(cfg_with({"reward": {"device_mapping": [0, 1], "backend": "hf:d2"}}))
    assert not cpu.role("reward").is_gpu and cpu.role("reward").world_size == 3
    assert gpu.role("reward").is_gpu and ("actor_train", "actor_infer", "reward") in gpu.colocated_sets


def test_disabled_and_null_roles_are_left_out() -> None:
    p = place(cfg_with({"critic": {"enabled": False, "device_mapping": "[0, 0]"}, "reference": None}))
    assert set(p.roles) == {"actor_train", "actor_infer"}


def test_cluster_nodes_and_cpus_reach_the_slurm_request() -> None:
    p = place(cfg_with({"code_sandbox": {"world_size": 5}}, {"nodes": 3, "cpus_per_task": 4, "gpus_per_node": 4}))
    assert p.num_nodes == 3
    # 2 GPU ranks on node 0 + controller; 5 CPU workers spread to the emptier nodes first.
    assert Counter(p.role("code_sandbox").nodes) == {0: 1, 1: 2, 2: 2}
    assert p.slurm == SlurmRequest(nodes=3, ntasks_per_node=4, gpus_per_node=2, cpus_per_task=4)


def test_plan_is_pure_and_deterministic() -> None:
    cfg = cfg_with({
        "actor_train": {"device_mapping": "list(range(0,16))", "backend": "fsdp:d16"},
        "actor_infer": {"device_mapping": "list(range(0,12))", "backend": "vllm:d6t2"},
        "code_sandbox": {"world_size": 8, "engine_args": {"timeout": 3}},
    })
    before = copy.deepcopy(cfg)
    a, b = place(cfg), place(cfg)
    assert cfg == before
    assert a == b and a.to_dict() == b.to_dict()
    assert a.role("code_sandbox").engine_args == {"timeout": 3}


def test_plan_accepts_the_schema_defaults_and_omegaconf() -> None:
    from omegaconf import OmegaConf

    from rlbatch.config.schema import RLBatchConfig

    p = place(RLBatchConfig())
    q = place(OmegaConf.structured(RLBatchConfig(run_dir="runs/x")))
    assert p == q
    assert set(p.roles) == {"actor_train", "actor_infer", "reference", "reward"}
    assert p.colocated_sets == (("actor_train", "actor_infer", "reference"),)


def test_slot_at_finds_every_process_and_reports_spares() -> None:
    p = place(cfg_with({
        "actor_train": {"device_mapping": "list(range(0,16))", "backend": "fsdp:d16"},
        "actor_infer": {"device_mapping": "list(range(0,16))", "backend": "hf:d16"},
        "code_sandbox": {"world_size": 1},
    }))
    for slot in p.processes:
        assert p.slot_at(slot.node, slot.local_rank) is slot
    # node 0: 8 GPUs + controller, node 1: 8 GPUs + the CPU worker -> no spare; ask past the end
    assert p.slot_at(1, p.slurm.ntasks_per_node) is None


# --------------------------------------------------------------------------- invalid configurations


def dm(spec: Any, prefix: str, *fragments: str) -> Any:
    return pytest.param("device_mapping", spec, prefix, fragments, id=f"dm:{str(spec)[:40]}")


def be(spec: Any, prefix: str, *fragments: str) -> Any:
    return pytest.param("backend", spec, prefix, fragments, id=f"backend:{str(spec)[:40]}")


def cf(name: str, patch: dict[str, Any], prefix: str, *fragments: str) -> Any:
    return pytest.param("config", patch, prefix, fragments, id=f"config:{name}")


R8 = "list(range(0,8))"
INVALID = [
    # device_mapping strings and values (prefix: the field the parser was given)
    dm("[0, 0]", "F", "listed more than once: [0]"),
    dm("[0] + range(0, 2)", "F", "listed more than once: [0]"),
    dm("[-1]", "F", ">= 0, got [-1]"),
    dm("range(-2, 2)", "F", ">= 0, got [-2, -1]"),
    dm("[]", "F", "empty"),
    dm("range(3, 3)", "F", "empty"),
    dm("", "F", "empty string"),
    dm("   ", "F", "empty string"),
    dm("[1.5]", "F", "unexpected character '.'"),
    dm("[0, True]", "F", "expected an integer"),
    dm("0", "F", "expected '[', 'range(' or 'list(range('"),
    dm("list([0, 1])", "F", "expected 'range'"),
    dm("tuple(range(2))", "F", "expected '[', 'range(' or 'list(range('"),
    dm("range(0, 8, 0)", "F", "step must not be zero"),
    dm("range(1, 2, 3, 4)", "F", "expected ')'"),
    dm("list(range(0, 2)", "F", "expected ')'"),
    dm("[0 1]", "F", "expected ','"),
    dm("range(0, 2) +", "F", "near 'end of input'"),
    dm("range(0, 2) range(2, 4)", "F", "unexpected trailing input"),
    dm("[10000000000]", "F", "too large"),
    dm("range(0, 100000)", "F", "100000 GPU ranks; the limit is 65536"),
    dm([0, True], "F", "F[1]", "got bool True"),
    dm([0, 1.0], "F", "F[1]", "got float 1.0"),
    dm(["0"], "F", "F[0]", "got str '0'"),
    dm(3, "F", "expected a list of GPU ranks", "got int 3"),
    dm({"a": 1}, "F", "expected a list of GPU ranks"),
    # backend strings
    be("d4t2", "F", "bare dims 'd4t2'", "engine prefix"),
    be("foo:d2", "F", "unknown engine 'foo'", "known engines: fsdp, megatron, deepspeed, vllm, sglang, hf"),
    be("FSDP:d2", "F", "unknown engine 'FSDP'"),
    be("fsdp", "F", "expected '<engine>:<dims>'"),
    be("fsdp:", "F", "has no dims"),
    be("fsdp:d0", "F", "must be >= 1, got d0"),
    be("fsdp:d-1", "F", "cannot parse dims 'd-1'"),
    be("fsdp:x2", "F", "cannot parse dims 'x2'"),
    be("fsdp:d2 t2", "F", "cannot parse dims"),
    be("fsdp:d2d2", "F", "'d' appears more than once"),
    be("fsdp:p2", "F", "does not accept 'p' (pipeline parallel)", "accepts d, t, c"),
    be("fsdp:e2", "F", "does not accept 'e' (expert parallel)"),
    be("deepspeed:t2", "F", "does not accept 't'", "accepts d"),
    be("vllm:c2", "F", "does not accept 'c'", "accepts d, t, p"),
    be("sglang:p2", "F", "does not accept 'p'", "accepts d, t"),
    be("hf:t2", "F", "engine 'hf' does not accept 't'"),
    be("fsdp:d99999999", "F", "larger than"),
    be("fsdp:d2" * 50, "F", "the limit is 256"),
    be(5, "F", "expected a backend string", "got int 5"),
    be(["fsdp:d2"], "F", "expected a backend string"),
    be("megatron:(attn:d4p2t2c2e2|ffn:d2p2t4e2)", "F", "attn section does not accept 'e'"),
    be("megatron:(attn:d4p2t2c2|ffn:d2p2t4c2)", "F", "ffn section does not accept 'c'"),
    be("megatron:(attn:d4p2t2c2|ffn:d2p1t4e2)", "F", "pipeline size must match: attn has p2, ffn has p1"),
    be("megatron:(attn:d4p2t2c2|ffn:d4p2t4e2)", "F", "world sizes differ: attn d*t*p*c = 32, ffn d*t*p*e = 64"),
    be("megatron:(attn:d4p2t2c2|ffn:p2t3e2)", "F", "cannot derive ffn d: attn world 32 is not divisible by ffn t*p*e = 12"),
    be("megatron:(attn:d4p2t2c2)", "F", "the hybrid form is"),
    be("megatron:(attn:|ffn:d2)", "F", "the attn section has no dims"),
    be("fsdp:(attn:d2|ffn:d2)", "F", "only for megatron"),
    # whole configurations
    cf("ngpw-contradicts-tp", {"roles": {"actor_train": {"device_mapping": R8, "backend": "fsdp:d8"},
                                         "actor_infer": {"device_mapping": R8, "backend": "vllm:d4t2", "num_gpus_per_worker": 4}}},
       "roles.actor_infer.num_gpus_per_worker", "is 4", "needs 2", "t*p = 2*1"),
    cf("ngpw-train-not-1", {"roles": {"actor_train": {"num_gpus_per_worker": 2}}},
       "roles.actor_train.num_gpus_per_worker", "is 2", "training engines use 1 GPU per worker"),
    cf("ngpw-zero", {"roles": {"actor_infer": {"num_gpus_per_worker": 0}}}, "roles.actor_infer.num_gpus_per_worker", ">= 1, got 0"),
    cf("ngpw-float", {"roles": {"actor_infer": {"num_gpus_per_worker": 1.0}}}, "roles.actor_infer.num_gpus_per_worker", "expected an integer, got float"),
    cf("not-divisible-by-ngpw", {"roles": {"actor_train": {"device_mapping": [0, 1, 2], "backend": "fsdp:d3"},
                                           "actor_infer": {"device_mapping": [0, 1, 2], "backend": "vllm:d2t2"}}},
       "roles.actor_infer", "device_mapping has 3 GPUs, not divisible by num_gpus_per_worker=2"),
    cf("gpus-differ-from-backend", {"roles": {"actor_train": {"backend": "fsdp:d4"}}},
       "roles.actor_train", "device_mapping has 2 GPUs but backend 'fsdp:d4' needs", "= 4"),
    cf("world-not-dividing", {"roles": {"actor_train": {"device_mapping": "range(4)", "backend": "fsdp:d4", "world_size": 3},
                                        "actor_infer": {"device_mapping": "range(4)", "backend": "hf:d4"}}},
       "roles.actor_train.world_size", "device_mapping has 4 GPUs, not divisible by world_size=3"),
    cf("world-implies-wrong-ngpw", {"roles": {"actor_train": {"device_mapping": R8, "backend": "fsdp:d8"},
                                              "actor_infer": {"device_mapping": R8, "backend": "vllm:d4t2", "world_size": 8}}},
       "roles.actor_infer.world_size", "gives 1 GPUs per worker", "needs 2"),
    cf("world-contradicts-ngpw", {"roles": {"actor_train": {"device_mapping": R8, "backend": "fsdp:d8"},
                                            "actor_infer": {"device_mapping": R8, "backend": "vllm:d4t2", "num_gpus_per_worker": 2, "world_size": 2}}},
       "roles.actor_infer.world_size", "is 2 but device_mapping has 8 GPUs / 2 per worker = 4 workers"),
    cf("world-string", {"roles": {"actor_train": {"world_size": "2"}}}, "roles.actor_train.world_size", "expected an integer, got str"),
    cf("beyond-the-cluster", {"cluster": {"nodes": 1}, "roles": {"actor_train": {"device_mapping": "range(0,16)", "backend": "fsdp:d16"},
                                                                "actor_infer": {"device_mapping": "range(0,16)", "backend": "hf:d16"}}},
       "roles.actor_train.device_mapping", "GPU ranks [8, 9", "beyond the cluster", "nodes=1 x gpus_per_node=8 = 8 GPUs"),
    cf("tp-spans-nodes", {"cluster": {"gpus_per_node": 4}, "roles": {"actor_train": {"device_mapping": R8, "backend": "fsdp:d8"},
                                                                    "actor_infer": {"device_mapping": R8, "backend": "vllm:d1t8"}}},
       "roles.actor_infer", "tensor-parallel (t=8) group", "spans nodes [0, 1]", "gpus_per_node=4"),
    cf("tp-misaligned", {"roles": {"actor_train": {"device_mapping": "range(0,10)", "backend": "fsdp:d10"},
                                   "actor_infer": {"device_mapping": "range(2,10)", "backend": "vllm:d2t4"}}},
       "roles.actor_infer", "GPU ranks [6, 7, 8, 9] spans nodes [0, 1]"),
    cf("fsdp-tp-spans-nodes", {"cluster": {"gpus_per_node": 2}, "roles": {"actor_train": {"device_mapping": "range(4)", "backend": "fsdp:t4"},
                                                                         "actor_infer": {"device_mapping": "range(4)", "backend": "hf:d4"}}},
       "roles.actor_train", "tensor-parallel (t=4)", "spans nodes"),
    cf("ep-spans-nodes", {"cluster": {"gpus_per_node": 4}, "roles": {"actor_train": {"device_mapping": R8, "backend": "megatron:d8e8"},
                                                                    "actor_infer": {"device_mapping": R8, "backend": "hf:d8"}}},
       "roles.actor_train", "expert-parallel (e=8) group", "spans nodes [0, 1]"),
    cf("hybrid-ep-spans-nodes", {"cluster": {"gpus_per_node": 4},
                                 "roles": {"actor_train": {"device_mapping": "range(32)", "backend": "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)"},
                                           "actor_infer": {"device_mapping": "range(32)", "backend": "hf:d32"}}},
       "roles.actor_train", "expert-parallel (e=2) group", "spans nodes"),
    cf("ep-not-dividing-stage", {"roles": {"actor_train": {"device_mapping": "range(4)", "backend": "megatron:d4e3"},
                                           "actor_infer": {"device_mapping": "range(4)", "backend": "hf:d4"}}},
       "roles.actor_train.backend", "expert parallel e=3 must divide", "= 4"),
    cf("gpu-role-empty", {"roles": {"reference": {}}}, "roles.reference", "neither device_mapping nor world_size"),
    cf("cpu-role-empty", {"roles": {"code_sandbox": {}}}, "roles.code_sandbox", "neither device_mapping nor world_size", "CPU role needs world_size"),
    cf("gpu-role-world-only", {"roles": {"critic": {"world_size": 2}}}, "roles.critic.device_mapping", "world_size alone describes a CPU role"),
    cf("role-unknown-field", {"roles": {"actor_infer": {"gpus": 2}}}, "roles.actor_infer", "unknown field(s) ['gpus']"),
    cf("cluster-unknown-field", {"cluster": {"gpu_per_node": 8}}, "cluster", "unknown field(s) ['gpu_per_node']"),
    cf("cpu-asks-device-mapping", {"roles": {"code_sandbox": {"world_size": 2, "device_mapping": [0]}}},
       "roles.code_sandbox", "asks for GPUs (device_mapping)"),
    cf("cpu-asks-backend", {"roles": {"code_sandbox": {"world_size": 2, "backend": "hf:d1"}}}, "roles.code_sandbox", "asks for GPUs (backend)"),
    cf("cpu-asks-gpus-per-worker", {"roles": {"code_sandbox": {"world_size": 2, "num_gpus_per_worker": 1}}},
       "roles.code_sandbox", "asks for GPUs (num_gpus_per_worker=1)"),
    cf("cpu-world-bool", {"roles": {"code_sandbox": {"world_size": True}}}, "roles.code_sandbox.world_size", "expected an integer, got bool True"),
    cf("cpu-world-zero", {"roles": {"code_sandbox": {"world_size": 0}}}, "roles.code_sandbox.world_size", "between 1 and 4096, got 0"),
    cf("cpu-world-huge", {"roles": {"code_sandbox": {"world_size": 5000}}}, "roles.code_sandbox.world_size", "between 1 and 4096, got 5000"),
    cf("actor-infer-missing", {"roles": {"actor_infer": DELETE}}, "roles.actor_infer", "required"),
    cf("actor-train-disabled", {"roles": {"actor_train": {"enabled": False}}}, "roles.actor_train", "required", "disabled"),
    cf("role-name", {"roles": {"Code-Sandbox": {"world_size": 1}}}, "roles", "'Code-Sandbox' must be lower_snake_case"),
    cf("role-not-mapping", {"roles": {"actor_infer": 3}}, "roles.actor_infer", "expected a mapping of fields, got int"),
    cf("roles-not-mapping", {"roles": DELETE}, "roles", "expected a mapping of role name to role config"),
    cf("gap-in-ranks", {"roles": {"actor_infer": {"device_mapping": [3, 4]}}}, "roles.actor_infer.device_mapping",
       "GPU ranks 3..4 leave GPU rank 2 (1 GPU) in no role's device_mapping", "the job would take 5 GPUs"),
    cf("nothing-to-inherit", {"roles": {"actor_train": {"backend": ""}, "reference": {"device_mapping": [0, 1], "backend": ""}}},
       "roles.reference.backend", "actor_train has none to inherit"),
    cf("inherited-bad-backend", {"roles": {"actor_train": {"backend": "fsdp:p2"}, "critic": {"device_mapping": [0, 1]}}},
       "roles.critic.backend (inherited from actor_train)", "does not accept 'p'"),
    cf("inherited-size-mismatch", {"roles": {"reference": {"device_mapping": "range(4)", "backend": ""}}},
       "roles.reference", "device_mapping has 4 GPUs but backend 'fsdp:d2' needs"),
    cf("gpu-reward-no-backend", {"roles": {"reward": {"device_mapping": [0, 1]}}}, "roles.reward.backend", "needs a backend"),
    cf("engine-args-list", {"roles": {"actor_infer": {"engine_args": [1, 2]}}}, "roles.actor_infer.engine_args", "expected a mapping"),
    cf("gpus-per-node-zero", {"cluster": {"gpus_per_node": 0}}, "cluster.gpus_per_node", "between 1 and 1024, got 0"),
    cf("gpus-per-node-string", {"cluster": {"gpus_per_node": "8"}}, "cluster.gpus_per_node", "expected an integer, got str '8'"),
    cf("gpus-per-node-none", {"cluster": {"gpus_per_node": None}}, "cluster.gpus_per_node", "expected an integer"),
    cf("nodes-zero", {"cluster": {"nodes": 0}}, "cluster.nodes", "between 1 and 65536, got 0"),
    cf("cpus-per-task-negative", {"cluster": {"cpus_per_task": -1}}, "cluster.cpus_per_task", "got -1"),
]


def test_the_invalid_table_is_large_and_mixed() -> None:
    kinds = Counter(p.values[0] for p in INVALID)
    assert len(INVALID) >= 40 and min(kinds.values()) >= 10, kinds


@pytest.mark.parametrize(("kind", "value", "prefix", "fragments"), INVALID)
def test_invalid_input_is_reported(kind: str, value: Any, prefix: str, fragments: tuple[str, ...]) -> None:
    if kind == "config":
        cfg = merge(BASE, value)
    else:
        field = f"roles.actor_train.{kind}"
        prefix = prefix.replace("F", field)
        fragments = tuple(f.replace("F[", f"{field}[") for f in fragments)
        # The parser alone ...
        parse = parse_device_mapping if kind == "device_mapping" else parse_backend
        with pytest.raises(ConfigError) as e:
            parse(value, field)
        assert e.value.problems[0].startswith(prefix), e.value.problems
        for fragment in fragments:
            assert fragment in str(e.value), (fragment, e.value.problems)
        # ... and through place(), in actor_train.
        cfg = merge(BASE, {"roles": {"actor_train": {kind: value}}})
    problems = problems_of(cfg)
    matching = [p for p in problems if p.startswith(prefix) and all(f in p for f in fragments)]
    assert matching, f"no problem starts with {prefix!r} and contains {fragments!r}: {problems!r}"


def test_every_problem_is_reported_at_once() -> None:
    cfg = {
        "cluster": {"gpus_per_node": 8, "nodes": 1, "bogus": 1},
        "roles": {
            "actor_train": {"device_mapping": "list(range(0,16))", "backend": "fsdp:d16"},
            "actor_infer": {"device_mapping": R8, "backend": "vllm:d4t2", "num_gpus_per_worker": 4},
            "reference": {"device_mapping": "[0, 0]", "backend": ""},
            "critic": {"enabled": True, "world_size": 2},
            "code_sandbox": {"world_size": 2, "device_mapping": [0]},
            "reward": {"world_size": 2, "extra": 1},
        },
    }
    fragments = [
        "cluster: unknown field(s) ['bogus']",
        "roles.actor_train.device_mapping: GPU ranks [8, 9, 10, 11, 12, 13, 14, 15] are beyond the cluster",
        "roles.actor_infer.num_gpus_per_worker: is 4",
        "roles.reference.device_mapping: GPU ranks listed more than once: [0]",
        "roles.critic.device_mapping: missing; world_size alone describes a CPU role",
        "roles.code_sandbox: is a CPU role but asks for GPUs",
        "roles.reward: unknown field(s) ['extra']",
    ]
    problems = problems_of(cfg)
    assert len(problems) == len(fragments), problems
    for fragment in fragments:
        assert sum(p.startswith(fragment) for p in problems) == 1, (fragment, problems)
    with pytest.raises(ConfigError) as e:
        place(cfg)
    assert str(e.value).startswith(f"{len(fragments)} problems in the configuration:")


def test_check_merges_placement_and_other_problems() -> None:
    cfg = merge(BASE, {
        "resume": "auto",
        "algo": {"name": "grpo", "advantage": "grpo", "samples_per_prompt": 1, "lr": -1.0, "top_p": 1.5, "kl_coef": 0},
        "data": {"name": "file"},
        "roles": {"actor_infer": {"backend": "hf:t2"}, "reward": {"world_size": 1}},
    })
    with pytest.raises(ConfigError) as e:
        check(cfg)
    text = "\n".join(e.value.problems)
    for fragment in [
        "roles.actor_infer.backend: engine 'hf' does not accept 't'",
        "algo.lr: must be >= 0, got -1.0",
        "algo.top_p: must be in (0, 1], got 1.5",
        "algo.samples_per_prompt: algo.advantage=grpo compares each sample with the others of its prompt",
        "data.path: data.name=file needs",
        "model.path: data.name=file needs",
    ]:
        assert fragment in text, (fragment, e.value.problems)
    assert len(e.value.problems) == 6


@pytest.mark.parametrize(
    ("algo", "fragment"),
    [
        (5, "algo: expected a mapping"),
        ({"name": "grpo", "samples_per_prompt": "8"}, "algo.samples_per_prompt: expected a number, got '8'"),
        ({"prompts_per_step": "x"}, "algo.prompts_per_step: expected a number"),
        ({"kl_coef": "x"}, "algo.kl_coef: expected a number"),
        ({"mini_batches": None, "grad_accum": True}, "algo.grad_accum: expected a number, got True"),
    ],
)
def test_check_reports_badly_typed_algo_without_crashing(algo: Any, fragment: str) -> None:
    cfg = merge(BASE, {"resume": "auto", "algo": algo})
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert any(p.startswith(fragment) for p in e.value.problems), e.value.problems


# --------------------------------------------------------------------------- properties

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.integers(-(10**15), 10**15),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
json_values = st.recursive(
    scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4), max_leaves=8
)
DM_PIECES = ["[", "]", "(", ")", ",", "+", " ", "range", "list", "0", "1", "2", "3", "4", "7", "8", "16",
             "-1", "999999999", "10**9", "x", "__import__", "'", '"', ".", ":", "lambda"]
ranks = st.integers(0, 20)
dm_terms = st.one_of(
    st.lists(ranks, max_size=6).map(lambda xs: "[" + ", ".join(map(str, xs)) + "]"),
    st.tuples(ranks, ranks).map(lambda ab: f"range({ab[0]}, {ab[1]})"),
    st.tuples(ranks, ranks).map(lambda ab: f"list(range({ab[0]},{ab[1]}))"),
    st.tuples(ranks, ranks, st.integers(-3, 3)).map(lambda t: f"range({t[0]}, {t[1]}, {t[2]})"),
)
dm_values = st.one_of(
    st.lists(st.sampled_from(DM_PIECES), max_size=16).map("".join),
    st.lists(dm_terms, min_size=1, max_size=3).map("+".join),
    st.lists(st.integers(-2, 20), max_size=10),
    json_values,
)
ENGINE_NAMES = ["fsdp", "megatron", "deepspeed", "vllm", "sglang", "hf", "archon", ""]
dims = st.lists(st.tuples(st.sampled_from("dtpcex"), st.integers(0, 9)), max_size=4).map(
    lambda ds: "".join(f"{a}{b}" for a, b in ds)
)
backend_values = st.one_of(
    st.tuples(st.sampled_from(ENGINE_NAMES), dims).map(lambda t: f"{t[0]}:{t[1]}"),
    st.tuples(dims, dims).map(lambda t: f"megatron:(attn:{t[0]}|ffn:{t[1]})"),
    st.lists(st.sampled_from([*ENGINE_NAMES, ":", "(", ")", "|", "attn:", "ffn:", "d2", "t2", "e2", "p2", " "]), max_size=10).map("".join),
    json_values,
)
small_ints = st.one_of(st.integers(-2, 16), json_values)
role_cfgs = st.one_of(
    st.fixed_dictionaries({}, optional={
        "enabled": st.one_of(st.booleans(), json_values),
        "device_mapping": dm_values,
        "backend": backend_values,
        "num_gpus_per_worker": small_ints,
        "world_size": small_ints,
        "offload": json_values,
        "engine_args": json_values,
        "bogus": json_values,
    }),
    json_values,
)
role_names = st.one_of(
    st.sampled_from(["actor_train", "actor_infer", "reference", "critic", "reward", "code_sandbox", "Bad-Name", ""]),
    st.text(max_size=8),
)
clusters = st.one_of(
    st.fixed_dictionaries({}, optional={
        "gpus_per_node": st.one_of(st.sampled_from([1, 2, 4, 8]), json_values),
        "nodes": small_ints,
        "cpus_per_task": small_ints,
        "name": json_values,
        "bogus": json_values,
    }),
    json_values,
)
configs = st.one_of(
    st.fixed_dictionaries(
        {"roles": st.one_of(st.dictionaries(role_names, role_cfgs, max_size=6), json_values)},
        optional={"cluster": clusters, "algo": json_values, "resume": json_values},
    ),
    json_values,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_plan_raises_nothing_but_config_error(cfg: Any) -> None:
    try:
        p = place(cfg)
    except ConfigError as e:
        assert e.problems and all(isinstance(x, str) and x for x in e.problems)
        return
    if _json_keys_ok(cfg):
        assert_json_round_trip(p)
    else:
        json.dumps(p.to_dict())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_check_raises_nothing_but_config_error(cfg: Any) -> None:
    try:
        check(cfg)
    except ConfigError as e:
        assert e.problems and all(isinstance(x, str) and x for x in e.problems)


def _json_keys_ok(obj: Any) -> bool:
    """engine_args with NaN or infinity cannot round-trip through strict JSON."""
    if isinstance(obj, float):
        return obj == obj and abs(obj) != float("inf")
    if isinstance(obj, dict):
        return all(_json_keys_ok(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_json_keys_ok(v) for v in obj)
    return True


@st.composite
def valid_configs(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    gpn = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 4 * gpn))
    train_ranks = draw(st.permutations(list(range(n))))
    roles: dict[str, Any] = {"actor_train": {"device_mapping": train_ranks, "backend": f"fsdp:d{n}"}}
    # actor_infer: k engine instances of t*p GPUs on an aligned block, so no TP group spans nodes.
    tp = draw(st.sampled_from([x for x in (1, 2, 4, 8) if x <= gpn and x <= n]))
    t = draw(st.sampled_from([x for x in (1, 2, 4, 8) if tp % x == 0]))
    k = draw(st.integers(1, n // tp))
    start = tp * draw(st.integers(0, n // tp - k))
    infer_ranks = list(range(start, start + k * tp))
    spec = draw(st.sampled_from([infer_ranks, f"list(range({start},{start + k * tp}))"]))
    roles["actor_infer"] = {"device_mapping": spec, "backend": f"vllm:d{k}t{t}p{tp // t}"}
    if draw(st.booleans()):
        m = draw(st.integers(1, n))
        sub = draw(st.permutations(list(range(n))))[:m]
        roles["reference"] = {"device_mapping": sub, "backend": "" if m == n else f"deepspeed:d{m}"}
    for i in range(draw(st.integers(0, 3))):
        roles[f"cpu_role_{i}"] = {"world_size": draw(st.integers(1, 12))}
    needed = -(-n // gpn)
    cluster: dict[str, Any] = {"gpus_per_node": gpn}
    if draw(st.booleans()):
        cluster["nodes"] = needed + draw(st.integers(0, 2))
    return {"roles": roles, "cluster": cluster}, needed


@settings(max_examples=200, deadline=None)
@given(valid_configs())
def test_valid_placements_are_consistent(case: tuple[dict[str, Any], int]) -> None:
    cfg, needed = case
    p = place(cfg)
    gpn, n = cfg["cluster"]["gpus_per_node"], len(cfg["roles"]["actor_train"]["device_mapping"])
    assert p.num_gpus == n and p.gpus_per_node == gpn
    assert p.num_nodes == p.slurm.nodes == cfg["cluster"].get("nodes", needed)
    assert p.slurm.gpus_per_node == min(gpn, n)

    # World ranks are 0..N-1, GPU ranks first, the controller last and alone.
    assert [s.world_rank for s in p.processes] == list(range(p.world_size))
    assert [s.kind for s in p.processes].count(ProcessKind.CONTROLLER) == 1
    assert p.processes[-1].kind is ProcessKind.CONTROLLER and p.controller_rank == p.world_size - 1
    # Every GPU rank is in exactly one process slot, on node rank // gpus_per_node.
    for r in range(n):
        slots = [s for s in p.processes if s.gpu_rank == r]
        assert len(slots) == 1
        s = slots[0]
        assert (s.world_rank, s.kind, s.node, s.local_gpu) == (r, ProcessKind.GPU, r // gpn, r % gpn)
    # Every slot is a distinct (node, local rank) task of the Slurm request.
    places = [(s.node, s.local_rank) for s in p.processes]
    assert len(set(places)) == len(places)
    for s in p.processes:
        assert 0 <= s.node < p.slurm.nodes and 0 <= s.local_rank < p.slurm.ntasks_per_node
        assert p.slot_at(s.node, s.local_rank) is s
    assert p.slurm.ntasks >= p.world_size

    # Workers partition each GPU role's ranks, and each rank's process lists the worker.
    served = Counter()
    for role in p.roles.values():
        if role.is_gpu:
            assert tuple(r for w in role.workers for r in w) == role.gpu_ranks
            assert len(role.workers) == role.world_size
            assert all(len(w) == role.num_gpus_per_worker for w in role.workers)
            assert role.nodes == tuple(w[0] // gpn for w in role.workers)
            for i, w in enumerate(role.workers):
                for r in w:
                    assert (role.name, i) in p.processes[r].roles
                    served[r] += 1
        else:
            assert len(role.workers) == role.world_size == len(role.nodes)
            for i, (rank,) in enumerate(role.workers):
                s = p.processes[rank]
                assert s.kind is ProcessKind.CPU and s.roles == ((role.name, i),) and s.node == role.nodes[i]
    assert all(len(p.processes[r].roles) == served[r] for r in range(n))
    # CPU processes (workers and the controller) are spread: node loads differ by at most one.
    cpu_load = Counter(s.node for s in p.processes if s.kind is not ProcessKind.GPU)
    loads = [cpu_load.get(node, 0) for node in range(p.num_nodes)]
    assert max(loads) - min(loads) <= 1
    # Colocation: roles that share a GPU are in one set, and colocated_with is symmetric.
    for r in range(n):
        names = p.roles_on_gpu(r)
        if len(names) > 1:
            assert any(set(names) <= set(s) for s in p.colocated_sets)
    for role in p.roles.values():
        for other in role.colocated_with:
            assert role.name in p.roles[other].colocated_with
    assert_json_round_trip(p)
