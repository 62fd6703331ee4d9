"""``model.lora.sync``: which form a LoRA policy's weight sync takes into which inference engine
(from the engines' registry), what validation refuses before start, and what the fsdp engine
streams for an adapter-only sync: the adapters alone, under PEFT's saved names, equal to its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlbatch.config.schema import LoraConfig
from rlbatch.engines.registry import spec_of
from rlbatch.models import lora
from tests.unit.test_lora import _engine


def test_the_sync_form_comes_from_the_inference_engines_spec() -> None:
    assert spec_of("vllm").loads_adapters and not spec_of("hf").loads_adapters
    on = LoraConfig(rank=16)
    assert lora.sync_form(on, spec_of("vllm").loads_adapters) == "adapter"
    assert lora.sync_form(on, spec_of("hf").loads_adapters) == "merged"  # auto: merged where adapters do not load
    assert lora.sync_form(LoraConfig(rank=16, sync="merged"), True) == "merged"
    assert lora.sync_form(LoraConfig(rank=0), True) is None  # no adapters: the weights as trained


def test_adapter_names_are_pefts_saved_names() -> None:
    assert lora.adapter_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert lora.adapter_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    assert lora.adapter_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") is None
    cfg = lora.adapter_config(LoraConfig(rank=8, alpha=16.0, target_modules=["v_proj", "q_proj"]))
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"], cfg["bias"]) == (8, 16.0, ["q_proj", "v_proj"], "none")


def test_adapter_sync_is_checked_before_start(cfg: dict[str, Any]) -> None:
    from rlbatch.checks.validate import check
    from tests.unit.configs import problems, set_

    check(set_(cfg, model__lora__rank=8, model__lora__sync="merged"))
    check(set_(cfg, model__lora__rank=8))  # auto on the hf engine: merged
    found = problems(set_(cfg, model__lora__rank=8, model__lora__sync="adapter"))
    assert any(p.startswith("model.lora.sync: adapter: the hf engine of roles.actor_infer does not load adapters "
                            "(vllm does)") for p in found), found
    found = problems(set_(cfg, model__lora__rank=8, model__lora__sync="adapters"))
    assert any("model.lora.sync: 'adapters' is not one of ['auto', 'merged', 'adapter']" in p for p in found), found
    vllm = set_(cfg, roles__actor_infer__backend="vllm:d2", model__num_heads=2, model__num_kv_heads=1)
    check(set_(vllm, model__lora__rank=16, model__lora__sync="adapter"))
    found = problems(set_(vllm, model__lora__rank=600))
    assert any("model.lora.rank: 600: vLLM loads adapters of rank at most 512" in p for p in found), found
    check(set_(vllm, model__lora__rank=600, model__lora__sync="merged"))


def test_the_fsdp_engine_streams_its_adapters_alone(one_rank_mesh: Any) -> None:
    engine = _engine(one_rank_mesh, 4)
    with torch.no_grad():  # B starts at zero: give every adapter a value of its own
        for n, p in engine.model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.full_like(p, float(len(n) % 7) + 0.5))
    own = {lora.adapter_name(n): p.full_tensor().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
    with engine.export_adapters() as stream:
        got = {n: t.clone() for unit in stream.units(torch.float32) for n, t in unit}
        assert [n for n, _ in stream.manifest] == list(got)
    assert got.keys() == own.keys() and all(torch.equal(got[n], own[n]) for n in own)
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in got)
    with engine.export_weights() as merged:
        whole = sum(s.numel() for _, s in merged.manifest)
    # the bytes an adapter sync moves against a merged one, on this model: the adapters' share
    assert sum(t.numel() for t in got.values()) == sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    assert sum(t.numel() for t in got.values()) < whole / 2


def test_an_adapter_sync_of_another_model_is_refused() -> None:
    from rlbatch.engines.vllm.engine import VLLMEngine

    engine = object.__new__(VLLMEngine)
    engine.lora = LoraConfig(rank=4)
    engine.expected_adapters = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.Size([4, 64])}
    engine._adapter_parts, engine._turns = {}, set()
    with pytest.raises(KeyError, match="are not the adapters of the model"):
        engine.load_adapters([("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(8, 64))])
    with pytest.raises(KeyError, match="are not the adapters of the model"):
        engine.load_adapters([("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 64))])


def test_vllm_keeps_its_base_weights_when_adapters_are_synced_alone() -> None:
    """A discard before a sync drops vLLM's weights (level-2 sleep) only when the sync brings them
    back: an adapter sync brings none, so they are kept (level 1, to host memory)."""
    from rlbatch.engines.vllm.engine import VLLMEngine

    levels = []
    engine = object.__new__(VLLMEngine)
    engine._put_away = lambda kinds, level: levels.append(level)  # type: ignore[method-assign]
    for held in (None, LoraConfig(rank=4)):
        engine.lora = held
        engine.discard(["params", "kv_cache"])
    assert levels == [2, 1]


def test_a_steps_sync_bytes_are_the_sum_of_its_syncs() -> None:
    """``sync/bytes``: what each sync moved rides on its sender's record of the phase; a step's row
    sums its syncs and has none without one."""
    from rlbatch.loop.metrics import reduce_records

    def rec(rank: int, phase: str, **extra: float) -> dict[str, Any]:
        moved = {"bytes": 0, "seconds": 0.0}
        return {"rank": rank, "phase": phase, "roles": ["actor_train"], "offload": moved, "reload": moved,
                "peak_allocated": 0, "mem_reserved_after": 0, "rss_after": 0} | extra

    assert "sync/bytes" not in reduce_records([rec(0, "train"), rec(1, "train")])
    got = reduce_records([rec(0, "sync", sync_bytes=180224.0), rec(1, "sync"), rec(0, "sync", sync_bytes=1000.0)])
    assert got["sync/bytes"] == 181224.0
