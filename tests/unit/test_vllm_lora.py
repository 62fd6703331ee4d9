"""Adapter-only weight sync into vLLM (its CPU build here): the engine starts with LoRA on and the
base weights; a sync of the adapters alone (PEFT's names, through ``AdapterSink`` as the weight
sync sends them) makes greedy generation equal transformers' greedy generation with the same
adapters merged into the base (what a merged sync gives vLLM: tests/unit/test_vllm_engine.py checks
vLLM after a merged sync against transformers token for token); the next sync's adapters replace
them; generating during a sync that has not brought every adapter is refused.

The checks run in a process of their own (this file as a script): a second vLLM engine in a
process where another one ran (tests/unit/test_vllm_engine.py's, in the same pytest process) finds
vLLM's process-wide distributed state of the first and does not start."""

from __future__ import annotations

import copy
import os
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext, SamplingParams, WeightStream
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.engines.vllm import VLLMArgs
from rlbatch.engines.vllm.engine import VLLMEngine
from rlbatch.loop.weightsync import AdapterSink, load_in_process
from rlbatch.models import lora
from tests.unit.infer_checks import run_in_a_process_of_its_own  # noqa: E402

SEED = 1
MODEL = ["model.num_heads=2", "model.num_kv_heads=1", "model.lora.rank=16", "model.lora.alpha=32"]
PROMPTS = ["1+2=", "3+4=", "7+8=", "9+9="]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.mark.timeout(900)
def test_adapter_sync_in_a_process_of_its_own() -> None:
    import vllm  # noqa: F401  (installed by make venv: its absence is a broken install, not a skip)

    run_in_a_process_of_its_own(__file__, "adapter sync checks passed")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:  # the program's world exists first, as on a rank
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        cfg = compose(MODEL)
        tok = load_tokenizer(cfg.model)
        engine = VLLMEngine(EngineContext("actor_infer", VLLMArgs(kv_cache_mb=64), cfg.model, cfg.algo, tok,
                                          torch.device("cpu"), seed=SEED))
        s = SimpleNamespace(cfg=cfg, tok=tok, engine=engine, prompts=[tok(p)["input_ids"] for p in PROMPTS])
        adapter_sync_generates_as_the_merged_model(s)
        generating_during_an_incomplete_adapter_sync_is_refused(s)
        engine.close()
        print("adapter sync checks passed", flush=True)
    os._exit(0)  # vLLM's one-rank world is left to process exit (rlbatch.engines.vllm.engine.VLLMEngine.close)


def _adapted(s: Any, seed: int) -> Any:
    """The base model with adapters of its own (B non-zero: the update is not zero)."""
    model = lora.adapt(load_model(s.cfg.model, s.tok, SEED, torch.float32), s.cfg.model.lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if lora.adapter_name(n) is not None:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _greedy(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def _adapters(model: Any) -> list[tuple[str, torch.Tensor]]:
    return [(a, p.detach()) for n, p in model.named_parameters() if (a := lora.adapter_name(n)) is not None]


def adapter_sync_generates_as_the_merged_model(s: Any) -> None:
    base = load_model(s.cfg.model, s.tok, SEED, torch.float32)
    assert [g.tokens for g in s.engine.generate(s.prompts, GREEDY)] == _greedy(base, s.prompts)  # no adapter yet
    for version, seed in enumerate((11, 12), start=1):
        model = _adapted(s, seed)
        named = _adapters(model)
        moved = load_in_process(WeightStream.of(named), AdapterSink(s.engine), torch.float32)
        assert moved == sum(t.numel() * 4 for _, t in named)
        assert s.engine.adapter_version == version
        merged = copy.deepcopy(model).merge_and_unload()
        want = _greedy(merged, s.prompts)
        assert want != _greedy(base, s.prompts)  # the adapters change the answers
        assert [g.tokens for g in s.engine.generate(s.prompts, GREEDY)] == want


def generating_during_an_incomplete_adapter_sync_is_refused(s: Any) -> None:
    named = _adapters(_adapted(s, 13))
    s.engine.load_adapters(named[:3])
    with pytest.raises(RuntimeError, match="incomplete adapter sync"):
        s.engine.generate(s.prompts, GREEDY)
    s.engine.load_adapters(named[3:])  # the rest completes it
    assert len(s.engine.generate(s.prompts, GREEDY)) == len(s.prompts)


if __name__ == "__main__":
    main()
