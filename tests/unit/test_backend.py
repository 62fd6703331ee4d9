"""Backend strings ``<engine>:<dims>`` (AReaL's allocation syntax), including hybrid MoE."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlbatch import ConfigError
from rlbatch.placement import parse_backend

# The spec's table, written out here so the test pins it (not read back from the code).
ENGINE_DIMS = {"fsdp": "dtc", "megatron": "dtpce", "deepspeed": "d", "vllm": "dtp", "sglang": "dt", "hf": "d"}
TRAIN_ENGINES = {"fsdp", "megatron", "deepspeed"}


# --------------------------------------------------------------------------- AReaL's examples


@pytest.mark.parametrize(
    ("spec", "engine", "dims", "world", "gpus_per_worker"),
    [
        ("fsdp:d8", "fsdp", dict(d=8), 8, 1),
        ("sglang:d2t4", "sglang", dict(d=2, t=4), 8, 4),  # 2 instances x 4 TP GPUs
        ("megatron:d2p2t4", "megatron", dict(d=2, p=2, t=4), 16, 1),
        ("megatron:d2p2t4e4", "megatron", dict(d=2, p=2, t=4, e=4), 16, 1),  # e adds no GPUs
        ("fsdp:d4t2", "fsdp", dict(d=4, t=2), 8, 1),
        ("sglang:d4t2", "sglang", dict(d=4, t=2), 8, 2),
        ("vllm:d2t4", "vllm", dict(d=2, t=4), 8, 4),
        ("vllm:d2t2p2", "vllm", dict(d=2, t=2, p=2), 8, 4),  # one instance uses t*p GPUs
        ("vllm:d8", "vllm", dict(d=8), 8, 1),
        ("fsdp:d2t2c2", "fsdp", dict(d=2, t=2, c=2), 8, 1),
        ("deepspeed:d4", "deepspeed", dict(d=4), 4, 1),
        ("hf:d2", "hf", dict(d=2), 2, 1),
        ("megatron:c2", "megatron", dict(c=2), 2, 1),
    ],
)
def test_areal_examples(spec: str, engine: str, dims: dict[str, int], world: int, gpus_per_worker: int) -> None:
    b = parse_backend(spec)
    assert b.engine == engine
    assert b.world_size == world
    for letter in "dtpce":
        assert getattr(b, letter) == dims.get(letter, 1), letter
    assert b.num_gpus_per_worker == gpus_per_worker
    assert b.attn is None and b.ffn is None


def test_dims_in_any_order_mean_the_same() -> None:
    specs = ["megatron:d2p2t4e4", "megatron:e4t4p2d2", "megatron:t4d2e4p2", " megatron : p2e4d2t4 "]
    parsed = [parse_backend(s) for s in specs]
    assert all(p == parsed[0] for p in parsed)
    assert str(parsed[0]) == str(parse_backend(str(parsed[0])))  # canonical form re-parses


def test_missing_dims_are_one() -> None:
    b = parse_backend("vllm:t4")
    assert (b.d, b.t, b.p, b.c, b.e) == (1, 4, 1, 1, 1)
    assert b.world_size == 4


def test_expert_parallel_adds_no_gpus() -> None:
    assert parse_backend("megatron:d4e4").world_size == parse_backend("megatron:d4").world_size == 4


@pytest.mark.parametrize("engine", sorted(ENGINE_DIMS))
@pytest.mark.parametrize("letter", list("dtpce"))
def test_dims_each_engine_accepts(engine: str, letter: str) -> None:
    spec = f"{engine}:{letter}2"
    if letter in ENGINE_DIMS[engine]:
        b = parse_backend(spec)
        assert getattr(b, letter) == 2
    else:
        with pytest.raises(ConfigError, match=f"does not accept '{letter}'"):
            parse_backend(spec)


@pytest.mark.parametrize("engine", sorted(ENGINE_DIMS))
def test_engine_kind_decides_gpus_per_worker(engine: str) -> None:
    dims = "".join(f"{x}2" for x in ENGINE_DIMS[engine] if x in "tp") or "d2"
    b = parse_backend(f"{engine}:{dims}")
    expected = 1 if engine in TRAIN_ENGINES else b.t * b.p
    assert b.num_gpus_per_worker == expected


def test_unknown_engine_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as e:
        parse_backend("archon:d2", "roles.actor_train.backend")
    msg = str(e.value)
    assert msg.startswith("roles.actor_train.backend")
    assert "unknown engine 'archon'" in msg
    for engine in ENGINE_DIMS:
        assert engine in msg


def test_bare_dims_are_refused_with_a_hint() -> None:
    with pytest.raises(ConfigError) as e:
        parse_backend("d4t2", "roles.actor_train.backend")
    assert "bare dims 'd4t2'" in str(e.value)
    assert "fsdp:d4t2" in str(e.value)


# --------------------------------------------------------------------------- hybrid MoE


def test_hybrid_moe_example() -> None:
    b = parse_backend("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)")
    assert b.engine == "megatron" and b.is_hybrid
    assert b.world_size == 32
    assert b.attn is not None and b.ffn is not None
    assert (b.attn.d, b.attn.p, b.attn.t, b.attn.c, b.attn.e) == (4, 2, 2, 2, 1)
    assert (b.ffn.d, b.ffn.p, b.ffn.t, b.ffn.c, b.ffn.e) == (2, 2, 4, 1, 2)
    assert b.ffn.d * b.ffn.t * b.ffn.p * b.ffn.e == 32
    assert b.num_gpus_per_worker == 1
    d = json.loads(json.dumps(b.to_dict()))
    assert d["world_size"] == 32 and d["ffn"]["world_size"] == 32 and d["attn"]["c"] == 2 and d["ffn"]["e"] == 2


def test_hybrid_ffn_d_is_derived_when_omitted() -> None:
    b = parse_backend("megatron:(attn:d4p2t2c2|ffn:p2t4e2)")
    assert b.ffn is not None and b.ffn.d == 2
    assert b == parse_backend("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)")


def test_hybrid_tolerates_spaces_and_round_trips() -> None:
    b = parse_backend("megatron:( attn: d4p2t2c2 | ffn: e2t4p2 )")
    assert str(b) == "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)"
    assert parse_backend(str(b)) == b


# --------------------------------------------------------------------------- hostile input

INJECTION = [
    "__import__('os').system('touch MARKER')",
    "fsdp:d2; touch MARKER",
    "fsdp:d2$(touch MARKER)",
    "fsdp:d2`touch MARKER`",
    "fsdp:__import__('os')",
    "megatron:(attn:d2|ffn:__import__('os').system('touch MARKER'))",
    "lambda: open('MARKER', 'w')",
    "fsdp:{open('MARKER','w')}",
]


@pytest.mark.parametrize("spec", INJECTION)
def test_injection_is_refused(spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError):
        parse_backend(spec)
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "spec",
    [
        "fsdp:" + "d1" * 500000,
        "(" * 100000,
        "megatron:" + "(" * 100000,
        "megatron:(attn:" + "d2" * 100 + "|ffn:" + "e2" * 100 + ")",
        "fsdp:d" + "9" * 100000,
        "fsdp:d" + "9" * 200,
        "fsdp:d99999999",
        "megatron:(attn:d" + "9" * 100 + "|ffn:e2)",
        "x" * (1 << 20),
    ],
)
def test_pathological_backend_fails_fast(spec: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ConfigError):
        parse_backend(spec)
    assert time.perf_counter() - start < 1.0
